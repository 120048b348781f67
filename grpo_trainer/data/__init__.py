"""Datasets: which prompt goes to which process and step (`sampler`), and the checks a dataset must pass."""
