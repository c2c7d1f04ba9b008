"""Co-located workers: each prefills and decodes its own requests (the baseline)."""
