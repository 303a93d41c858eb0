"""Delta rounds: a round's stream patched against the last committed one (transport protocol 3).

- :mod:`.encoding`: the delta encoding: tile-by-tile patches, digests of rebuilt buckets, round ids
- :mod:`.rounds`: the sender's delta base: a delta or a whole round
- :mod:`.stream`: the sender's half: a delta round's buckets encoded and posted as they are
  quantized
- :mod:`.ahead`: the sender's source run ahead on a second thread, so quantizing and encoding
  overlap
- :mod:`.digest`: the sender's per-bucket digests from the row sums kept for its base and the
  changed words, without reading each region again
- :mod:`.requantize`: the sender's incremental quantizer: each round re-encodes only what the
  step changed, bit for bit a full quantize
- :mod:`.scan`: the compare's CPU kernel: changed words found and their elements written out in
  one pass (numba)
- :mod:`.patch_kernel`: the patch's CPU kernels: a bucket's patch coded and applied in one pass
  over its changes (numba)
- :mod:`.written`: the quantizer's record of the bytes it wrote, so the stream copies and
  compares only those
- :mod:`.rebuild`: the receiver's delta base and the decoder that rebuilds a round from it
- :mod:`.receive`: the receiver's half: buckets received, rebuilt and verified one at a time
- :mod:`.churn`: how a quantized checkpoint changes per RL step (``qstrat bench --only delta``)
"""
