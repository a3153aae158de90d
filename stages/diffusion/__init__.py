"""What the flow-matching policy (stages/policies/flow.py) is made of, for any flow family: the
sampling plan and loop, the stored latent trajectory, prompt conditioning bound to a velocity,
VAE warm-up and flow-matching SFT, held-out toy-GenEval evaluation and image grids. Plain torch;
the worker (stages/workers/worker.py) owns the models and the process group."""
