"""The KV event plane: wire types, block hashing, the prefix index, its subscriber and load reports.

Imports nothing else of kvgate's: the router and the workers both build on it.
"""
