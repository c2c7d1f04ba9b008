"""The `launch` command: spawning, GPU assignment, health, restart, shutdown."""
