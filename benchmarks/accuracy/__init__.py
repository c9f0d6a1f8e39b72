"""The parts of the accuracy harness (`benchmarks/parity.py`), outside the installed package: the graded-shapes
task, one run on it, the simulated all-int8 linear, the paired summary. Import with benchmarks/ on sys.path."""
