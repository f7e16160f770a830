"""edgefinfer.runtime."""
