"""Client-side measurement machinery (load generation), shared by tests and jobs."""
