"""Research tools of the accuracy harness (`benchmarks/parity.py`), kept out of the installed package.

    graded_shapes   a synthetic captioned-shapes task with graded difficulty, batches a pure function of (seed, step)
    grad_quant_sim  simulated (fake-quantized) output-gradient quantizers
    sim_switchback  a SwitchBack linear simulated in torch with one of those quantizers

Import them with benchmarks/ on sys.path: `from accuracy import graded_shapes`.
"""
