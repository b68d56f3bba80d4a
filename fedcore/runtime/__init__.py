"""A course's machinery: the course itself, its devices, time model, sampling, admission
of updates, checkpoints and snapshots, monitor, progress and loggers.
"""
