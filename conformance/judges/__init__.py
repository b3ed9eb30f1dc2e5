"""The judges: how a backend's answer is compared with the spec's.

``compare`` locates the first difference in KV or outputs; ``numerics`` judges outputs in
ulps of their dtype against a same-precision reference; ``guard`` catches writes into
read-only inputs and live views; ``device_contract`` checks what a tensor-resident backend
returns; ``coverage`` counts what a run reached; ``dtypes`` maps dtype names.
"""
