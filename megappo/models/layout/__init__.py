"""A micro-batch's layout: padded rows, one pack of its sequences (THD), or this context-parallel rank's chunks.

Everything that differs between the layouts lives here: the plan that picks the layout once per step and lays out
each micro-batch (`plan`), the packing math (`packing`), the context-parallel split and gathers
(`context_parallel`), and how megappo's SDPAttention attends in each layout (`attention`). The forward step, the
loss closures and the attention ask the layout; none of them tests which one it is.
"""
