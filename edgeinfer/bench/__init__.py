"""``edgeinfer bench``: models and backends side by side, from launch to the last token.

For each configuration (a model on a backend) it reports load time, cold start, TTFT,
time per output token (P50/P95/P99), prefill and decode tokens/s, peak RSS, the share
of each engine stage (tokenize, prefill, decode, sample, detokenize) and the decode
speed that memory bandwidth allows.

- ``runner``: ``bench()``, which checks everything, starts the workers and drives them;
- ``worker``: what runs in each worker process;
- ``report``: what was measured, as a table, JSON or a plot.

How it measures:

- Every configuration runs in its own fresh worker process (``python -m edgeinfer.bench.worker``),
  so load time and peak RSS are that configuration's alone.
- The prompt is text that tokenizes to exactly ``prompt_tokens`` ids; decoding is greedy
  with end-of-generation ignored, so every run generates exactly ``gen_tokens`` tokens.
  The KV cache holds prompt and answer (nothing is evicted) and is emptied before every
  run, so each run prefills the whole prompt.
- Load: the worker's ``Engine(...)`` call. Cold start: from launching the worker (before
  its interpreter starts) to its first text arriving here: interpreter, imports, load,
  prefill and the first token. One sample per configuration; that first generation is
  also the warm-up.
- Then ``runs`` measured runs. Wall time on a shared machine drifts by more than the
  differences measured, so when every configuration fits in RAM at once they stay loaded
  and take turns run by run, the order reversing each round; otherwise they run one
  after another.
- TTFT, prefill and decode tokens/s and stage times are the engine's ``Metrics``, median
  over runs; TPOT percentiles pool the gaps between consecutive tokens of every run.
- Peak RSS: the worker's own high-water mark (``system.peak_rss``), which counts the pages of
  mapped weights it touched.
- Decode roofline: the bytes one decode step must read (every weight tensor in the GGUF,
  less the token embedding when a separate output matrix exists, scaled by how much the
  backend expands the file in RAM (4 bytes a weight for the reference), plus the f16 KV cache
  at the middle of the answer) divided by the read bandwidth numpy reaches summing a
  buffer of that size (at most 1 GiB) on the same number of threads, best of 3 passes.
  A model that fits in the CPU cache is thus held to the cache's bandwidth, as its
  backend is. On a GPU (``--device``, or the vulkan backend) there is no roofline: host bandwidth says
  nothing of it.
"""
