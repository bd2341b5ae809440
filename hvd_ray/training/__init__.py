"""Offline training of draft models (the EAGLE-3 head), over the model layer; the Ray Train jobs
that drive it live in ``jobs/``."""
