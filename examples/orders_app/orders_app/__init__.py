"""An example app: it places orders (outbox) and reacts to payments (inbox)."""
