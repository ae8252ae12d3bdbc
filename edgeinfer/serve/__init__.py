"""``edgeinfer serve``: one model on this box, served over an OpenAI-compatible HTTP API to several clients.

``protocol`` parses requests and builds responses, ``app`` is the Starlette app (slots, queue, endpoints),
``metrics`` its Prometheus counters, ``runner`` runs it under uvicorn. The batching itself is the engine's:
every slot's answer is decoded in the same backend step.
"""
