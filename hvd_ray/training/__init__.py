"""Offline training: the EAGLE-3 draft head (``eagle3.py``, over the model layer) and the yield
predictor (``predictor.py``, on trace-replay labels); the jobs that drive them live in ``jobs/``."""
