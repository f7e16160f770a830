"""edgefinfer.prune."""
