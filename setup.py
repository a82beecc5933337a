from setuptools import find_packages, setup

setup(
    name="splitmoe",
    version="0.1.0",
    description="Attention-FFN disaggregated inference runtime for Mixture-of-Experts models",
    packages=find_packages(include=["splitmoe", "splitmoe.*"]),
    package_data={
        "splitmoe.sim": ["profiles/*.json", "profiles/measured/*.json", "configs/*.json"],
        "splitmoe.kernels": ["*.c", "*.h"],  # the native CPU kernels, compiled on first use
    },
    python_requires=">=3.10",
    # torch is pinned by the install scripts (scripts/setup_env.sh) to a CPU build on machines
    # without CUDA; here we only state the lower bound the code needs.
    install_requires=[
        "torch>=2.4",
        "safetensors>=0.4",
        "tokenizers>=0.15",
        "numpy",
        "tqdm",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "prometheus_client>=0.20",
        "jinja2>=3.1.6",
        "matplotlib",
        "pydantic>=2.7",
        "xgrammar>=0.1.25",  # structured output (response_format, SamplingParams.json_schema)
        "msgspec>=0.18",  # typed messages (the engine protocol, the KV agents' side channel)
        "pyzmq>=25",  # the engine's control plane (splitmoe.engine.transport)
        "httpx>=0.27",  # the prefill-decode router's client (python -m splitmoe.router)
        "tiktoken>=0.7",  # tokenizers released as tiktoken files (Kimi-K2)
    ],
    entry_points={"console_scripts": ["splitmoe=splitmoe.cli:main"]},
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",
            "transformers>=4.51",
            "triton>=3.0",
            "ruff",
            "openai>=1.0",
            "hypothesis",
            "schemathesis>=4",
            "jsonschema",
        ],
        "mpi": ["mpi4py>=3.1", "openmpi"],
        # prefill-decode disaggregation: KV blocks move through Mooncake's transfer engine
        # (TCP on one host, RDMA on clusters; needs the system library libibverbs1)
        "pd": ["mooncake-transfer-engine-non-cuda"],
        "triton": ["triton>=3.0"],
    },
)
