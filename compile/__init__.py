"""edgefinfer.compile."""
