"""The sandbox's zygote and its helpers: standard library only, no megappo imports. `megappo.sandbox.Sandbox` starts
`zygote.py` with `python -I`, which loads the other modules by path (`kernel.load`)."""
