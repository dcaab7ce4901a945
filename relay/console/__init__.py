"""`relay console`: the operator's web console (Starlette, Jinja2, no JavaScript).

See relay.console.app for the pages and the rules that keep it safe.
"""
