"""The terminal chat (``edgeinfer chat``): a Textual app over the public edgeinfer API."""
