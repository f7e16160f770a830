"""edgefinfer.distill."""
