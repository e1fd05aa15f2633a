"""The rules of the games and of a sale, with no I/O: calendars, combinations, validation,
decisions, the wire types.
"""
