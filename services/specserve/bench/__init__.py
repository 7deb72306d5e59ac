"""`specserve bench`: side-by-side speed measurements in one process, JSON + PNG."""
