"""beam_jobs."""
