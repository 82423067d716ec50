"""The `rollout:` section: the engine, the batch, the sampling options and multi-turn tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vlrft.config.checks import _fail, _positive
from vlrft.config.options import option
from vlrft.errors import ConfigError


@dataclass
class ToolConfig:
    """One tool of multi-turn rollouts: a built-in name, `module:function` or `path.py:function`."""

    name: str = option("", "a built-in tool ('zoom', 'crop'), 'module:function' or 'path.py:function'")
    alias: str | None = option(None, "the name the model calls it by; default: the tool's registered name")
    description: str | None = option(None, "what the model is told the tool does; default: the tool's own")
    parameters: dict[str, Any] | None = option(None, "JSON schema of the arguments; default: the tool's own")
    kwargs: dict[str, Any] = option(help="fixed keyword arguments, in ToolContext.kwargs", factory=dict)


@dataclass
class RolloutConfig:
    """Sampling completions: the engine, the batch and the sampling options."""

    engine: Literal["hf", "vllm", "sglang", "vllm_server"] = option(
        "hf", "'hf': transformers on the policy itself (no extra memory); 'vllm' / 'sglang': a colocated engine on "
        "the GPU (much faster sampling); 'vllm_server': vLLM servers of their own (rollout.server_urls, "
        "docs/engines.md 'Rollout servers')")
    n: int = option(8, "completions per prompt (the group size of GRPO/RLOO)", minimum=1)
    global_batch_completions: int = option(64, "completions per step over all ranks (= prompts per step * "
                                           "rollout.n); was rollout.batch_size", minimum=1)
    max_new_tokens: int = option(512, "longest completion in tokens; longer ones are cut and flagged as truncated", minimum=1)
    min_new_tokens: int = option(0, "stop tokens are not sampled before this many tokens", minimum=0)
    temperature: float = option(1.0, "sampling temperature; 0 = greedy. The trainer's logprobs use the same one")
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off")
    top_k: int = option(0, "sample only among the k most likely tokens; 0 = off", minimum=-1)
    min_p: float = option(0.0, "drop tokens less likely than min_p times the most likely one; 0 = off")
    repetition_penalty: float = option(1.0, "divide the logits of tokens already in the sequence by this; 1 = off")
    stop: list[str] = option(help="stop strings; the completion ends right after the first one", factory=list)
    stop_token_ids: list[int] = option(help="extra token ids that end a completion (besides the model's EOS)",
                                       factory=list, minimum=0)
    lean_decode: bool = option(True, "hf engine: Qwen2/2.5/3-VL, InternVL 3, LLaVA-OneVision and SmolVLM decode steps run the layers' arithmetic directly "
                               "(weights read in place, preallocated KV cache) instead of through transformers' "
                               "modules (LoRA adapters as base weight + delta); other models and DoRA decode through "
                               "transformers")
    cuda_graph_decode: bool | None = option(None, "hf engine, lean decoding: record the decode step once per "
                                            "generate call as a CUDA graph and replay it per token (every row "
                                            "computed until all stop, attention over all max_new_tokens positions). "
                                            "None = on CUDA devices (an H100 sampled 3.8-4.3x the tokens/s of "
                                            "eager lean steps, forced lengths, one process: docs/gpu_results.md), "
                                            "off elsewhere; true off CUDA runs the "
                                            "same fixed-shape steps eagerly (slower)")
    # vLLM / SGLang only
    gpu_memory_utilization: float = option(0.5, "vLLM/SGLang: fraction of the GPU the engine may take (vLLM) / "
                                           "its static memory (SGLang)")
    tensor_parallel_size: int = option(1, "vLLM/SGLang: ranks sharing one engine (within a node); must divide the "
                                       "number of processes", minimum=1)
    sleep_between_steps: bool = option(True, "vLLM/SGLang: release engine weights and KV cache while the trainer "
                                       "runs")
    max_model_len: int | None = option(None, "vLLM/SGLang: longest sequence; default: data.max_prompt_length + "
                                       "rollout.max_new_tokens (with tools: + rollout.max_trajectory_tokens; SGLang + 1)", minimum=1)
    weight_sync_bucket_mb: int = option(512, "vLLM/SGLang: weights are sent to the engine in buckets of about "
                                        "this many MB", minimum=1)
    engine_kwargs: dict[str, Any] = option(help="vLLM/SGLang: passed verbatim to vllm.LLM / sglang.Engine",
                                           factory=dict)
    # Rollout servers (rollout.engine=vllm_server)
    server_urls: list[str] = option(help="vllm_server: the vLLM servers' base URLs, e.g. [http://10.0.0.5:8000]; a "
                                    "prompt's group goes to the one with the fewest outstanding requests",
                                    factory=list)
    server_timeout_s: float = option(600.0, "vllm_server: seconds one request may take before its server counts as "
                                     "dead (its requests go to the others)")
    weight_transfer: Literal["shm", "gloo"] = option(
        "shm", "vllm_server: how weights reach the servers: 'shm' (files in /dev/shm; the servers on the trainer's "
        "host) or 'gloo' (a torch.distributed gloo broadcast over TCP; servers on any node). The servers must be "
        "started with the matching backend: `vlrft serve-command --weight-transfer gloo`")
    weight_transfer_address: str | None = option(
        None, "vllm_server, weight_transfer=gloo: the trainer's address as the servers reach it; default: its "
        "address on the route to the first server")
    weight_transfer_port: int = option(0, "vllm_server, weight_transfer=gloo: the port the servers join the "
                                       "trainer's group at; 0: a free one", minimum=0)
    max_staleness: int = option(0, "vllm_server: policy versions a rollout may lag behind the weights it trains: "
                                "0 = synchronous (generate, then train); k >= 1 = the servers generate the next "
                                "steps while the trainer trains, each rollout at most k syncs old", minimum=0)
    # Multi-turn rollouts with tools (docs/multiturn.md); off while `tools` is empty
    tools: list[ToolConfig] = option(help="tools the model may call (list of {name, alias, description, "
                                     "parameters, kwargs}); non-empty turns on multi-turn rollouts", factory=list)
    max_turns: int = option(4, "multi-turn: most model turns per trajectory (tools answer at most max_turns - 1 "
                            "calls)", minimum=1)
    max_trajectory_tokens: int = option(2048, "multi-turn: most tokens after the prompt per trajectory (model "
                                        "turns, tool outputs and their images); past it the trajectory is truncated", minimum=1)
    tool_timeout_s: float = option(30.0, "multi-turn: seconds one tool call may take; then the model reads a "
                                   "timeout error and the call is counted in tools/timeouts")
    tool_max_concurrency: int = option(16, "multi-turn: tool calls running at once (across the batch)", minimum=1)
    tool_parser: str = option("qwen", "multi-turn: how a turn's tool call is found: 'qwen' (<tool_call>{\"name\": ..., "
                              "\"arguments\": {...}}</tool_call>) or 'module:function' / 'path.py:function' mapping "
                              "the turn's text to a vlrft.tools.ToolCall, MalformedCall or None (no call)")
    tool_image_max_pixels: int = option(0, "multi-turn: most pixels of an image a tool returns (a zoomed crop can be "
                                        "shown sharper than the prompt's image); 0: data.max_pixels; capped by the "
                                        "processor's own max_pixels", minimum=0)
    tool_max_output_tokens: int = option(0, "multi-turn: most tokens of a tool's text the model reads; longer text is "
                                         "cut (a note says how much) and counted in tools/truncated_outputs; 0: no "
                                         "cap (an observation past max_trajectory_tokens ends the trajectory)", minimum=0)
    describe_tools: bool = option(True, "multi-turn: describe the tools (their JSON schemas) in every prompt, through "
                                  "the chat template's tools; false when the data's prompts already say how to call "
                                  "them (the schemas cost hundreds of prompt tokens)")

    def validate_tools(self) -> None:
        """Multi-turn limits and that every tool name resolves (at load time, not mid-run)."""
        if not self.tools:
            return
        from vlrft.registry import TOOLS

        _positive("rollout.max_turns", self.max_turns)
        _positive("rollout.max_trajectory_tokens", self.max_trajectory_tokens)
        _positive("rollout.tool_max_concurrency", self.tool_max_concurrency)
        if self.tool_image_max_pixels < 0:
            _fail("rollout.tool_image_max_pixels", self.tool_image_max_pixels, "0 (as data.max_pixels) or a pixel count")
        if self.tool_timeout_s <= 0:
            _fail("rollout.tool_timeout_s", self.tool_timeout_s, "a number of seconds > 0")
        if self.tool_parser != "qwen":
            from vlrft.registry import load_reference

            load_reference(self.tool_parser, f"rollout.tool_parser={self.tool_parser!r}")
        for i, spec in enumerate(self.tools):
            if not spec.name:
                _fail(f"rollout.tools[{i}].name", spec.name, "a tool: a built-in name, 'module:function' or "
                      "'path.py:function'")
            try:
                TOOLS.is_known(spec.name)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("rollout.tools[*].name", f"rollout.tools[{i}].name", 1)) from None

    @property
    def tokens_after_prompt(self) -> int:
        """Most tokens a row holds after its prompt: one completion, or with tools a whole trajectory."""
        return self.max_trajectory_tokens if self.tools else self.max_new_tokens

    def engine_max_len(self, max_prompt_length: int) -> int:
        """vLLM/SGLang's longest sequence: `max_model_len`, else a request's longest input plus the tokens it asks for.

        Without tools the input is the prompt. With tools a later turn's input is the prompt and the trajectory so
        far, and one `max_new_tokens` is asked for all rows of a turn (what a row has no room for is cut after).
        A length over the model's own limit is refused by the engine at start; set `max_model_len` then.
        """
        if self.max_model_len:
            return self.max_model_len
        return max_prompt_length + (self.max_trajectory_tokens if self.tools else 0) + self.max_new_tokens

    @property
    def batch_size(self) -> int:
        """Old name of `global_batch_completions`, for code written against it (config files get a warning)."""
        return self.global_batch_completions

