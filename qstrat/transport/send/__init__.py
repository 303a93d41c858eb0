"""The trainer side of a transport round, driven from a ``RefitDriver`` plan.

- :mod:`.sender`: :class:`RefitSender`: a round's weight-sync calls around the bucket stream
- :mod:`.sender_protocol`: rank 0's protocol steps and the round's outcome
- :mod:`.outgoing`: the bucket stream: source, pack buffers, sealing, the ABORT protocol
- :mod:`.fanout`: each weight-sync call fanned out to every engine
- :mod:`.report`: :class:`TransferReport`: what a round returns
"""
