"""What the frontend reports about itself: Prometheus metrics and the periodic stats line."""
