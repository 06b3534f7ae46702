"""The vote-sized passes of the routing algorithms: their equations, a reference, and dense and
chunked autograd versions side by side (how each runs: capsctl/layers/backend/).

- routed.py: inverted dot-product attention's routed pass (the letters of every shape comment
  and the backward derivation are in its docstring);
- weighted.py: votes summed with given coefficients; gated.py: self-routing's gated pass;
- em_moments.py: EM routing's M-step moments and E-step quadratic form;
- tiles.py: the tile buffers, layouts, tile shapes and gradient accumulators the chunked passes
  share;
- pose_norm.py and rows_first.py: the capsules' LayerNorm (and the rows-first layout of 4x4
  poses it reads and writes); layout.py: layout copies of poses (permuted copies, conv windows);
- flops.py: the tally of the routing's elementwise FLOPs.
"""
