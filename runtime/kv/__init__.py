"""edgefinfer.runtime.kv."""
