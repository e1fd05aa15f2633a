"""The HTTP API: routes and handlers, responses, the OpenAPI document, and the server that
wires and runs them.
"""
