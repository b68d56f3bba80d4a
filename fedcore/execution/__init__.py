"""Executors: how a course runs the local trainings it asks for (sequential, vectorized
over stacked parameters, worker processes, Ray actors), and the pieces the
vectorized engine is made of.
"""
