"""The accuracy harness's parts (`benchmarks/parity.py` is its command line), kept out of the installed package.

    graded_shapes   a synthetic captioned-shapes task with graded difficulty, batches a pure function of (seed, step)
    graded_run      one small-CLIP run on that task, in its own training loop
    train_clip_run  one examples/train_clip.py run (the train_clip protocol)
    summary         runs paired with bf16: intervals, verdicts, the table and the plot
    grad_quant_sim  simulated (fake-quantized) output-gradient quantizers
    sim_switchback  a SwitchBack linear simulated in torch with one of those quantizers

Import them with benchmarks/ on sys.path: `from accuracy import graded_shapes`.
"""
