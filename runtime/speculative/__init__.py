"""edgefinfer.runtime.speculative."""
