"""`relay console`: the operator's web console (Starlette, Jinja2, no JavaScript).

See relay.console.app for how it is assembled and the rules that keep it safe.
"""
