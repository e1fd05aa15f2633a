"""Redis: the transport (standalone, Sentinel, Cluster), the keys and the typed replies of the
Lua functions (lua/capsvc.lua), the marks, the embedded server.
"""
