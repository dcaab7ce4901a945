"""The console's pages, one module each (as Flower's flower/views/): each
holds `async def page(site, request)` (and the POSTs it answers);
relay.console.app routes to them."""
