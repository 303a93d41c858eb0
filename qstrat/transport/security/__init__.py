"""Who may join a round and what proves a bucket: keys, authentication, address, checksums.

- :mod:`.keys`: the shared secret and its key schedule (one HKDF subkey per use), the MACs
- :mod:`.auth`: round authentication: what the round MAC binds, a receiver's checks, signed init
- :mod:`.address`: the one trainer address an engine may join
- :mod:`.checksum`: the per-bucket integrity checksum, tensor ops on the payload's device (its row sums
  one numba loop on CPU)
- :mod:`.nh`: NH universal hashing (UMAC, RFC 4418) on the payload's device, for the bucket MAC
- :mod:`.seal`: the bucket seal both sides compute (a MAC with a secret, the checksum without)
"""
