"""edgefinfer.server_gpu."""
