"""Jobs: the caption job over a dataset (scan, resume, records, Ray)."""
