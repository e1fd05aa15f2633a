"""The use-cases: selling, looking up and cancelling tickets (tickets.py, in the order of a
sale), their steps in Redis, the janitor, draws, players, availability, exposure, the sold-
out feed.
"""
