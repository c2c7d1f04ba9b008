"""What crosses a process boundary: request parameters, records and their codec, ring names.

The bottom of the house: it imports nothing of ours, so ``transport/`` and ``engine/``
can both speak these types without depending on each other.
"""
