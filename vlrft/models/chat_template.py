"""Chat templates of the tiny models built locally (real checkpoints ship their own): Qwen-VL, GLM-4.1V, Gemma 3,
InternVL 3, LLaVA-OneVision, SmolVLM.

The Qwen-VL one renders ChatML (`<|im_start|>role ... <|im_end|>`), adds the default system prompt when the
conversation has none, and turns each image/video content part into
`<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad to one token per merged
patch). This is the layout of the Qwen2-VL / Qwen2.5-VL instruct checkpoints.
"""

QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# GLM-4.1V's layout (the GLM-4.1V-9B-Thinking chat template): `[gMASK]<sop>` once, then `<|role|>\n` before each
# message's content, no end-of-turn token (the next role token ends a turn: the model stops on `<|user|>`), an image
# part as `<|begin_of_image|><|image|><|end_of_image|>` and a video part as
# `<|begin_of_video|><|video|><|end_of_video|>` (the processor expands `<|image|>` to one token per merged patch, a
# video to timestamped frames). Tool results are `<|observation|>` turns. Text parts of any role are written in order.
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|observation|>\n{% else %}<|{{ message['role'] }}|>\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'video' or 'video' in content %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Gemma 3's layout (the gemma-3-*-it chat template, without its system-prompt folding): `<bos>` once, then
# `<start_of_turn>role\n` (the assistant's role is `model`) and the content, each text part trimmed, an image part as
# `<start_of_image>` (the processor expands it to `\n\n<start_of_image>` + mm_tokens_per_image `<image_soft_token>`
# + `<end_of_image>\n\n`), `<end_of_turn>\n` after each message.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}<start_of_image>"
    "{% elif 'text' in item %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# InternVL 3's layout (the OpenGVLab/InternVL3-*-hf chat template): ChatML turns, no default system prompt, an image
# part as `<IMG_CONTEXT>\n` and a video part as `<video>\n` (the processor expands an image to `<img>`, 256
# `<IMG_CONTEXT>`s per tile, `</img>`), text parts in order.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'video' or 'video' in content %}<video>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-OneVision's layout (the llava-hf/llava-onevision-qwen2-*-ov-hf chat template): ChatML turns with the role
# followed by a space, a message's images first (`<image>` each, expanded by the processor to the anyres features),
# then its videos, then each text part after a newline.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ '\\n' + message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}<image>{% endif %}"
    "{% endfor %}"
    "{% for content in message['content'] %}{% if content['type'] == 'video' %}<video>{% endif %}{% endfor %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ '\\n' + content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# SmolVLM's layout (the SmolVLM2 instruct checkpoints' chat template, as transformers' SmolVLM processor carries it):
# `<|im_start|>` once, then `Role:` (capitalised; `Role: ` unless the message opens with an image) and the content,
# an image part as `<image>` (the processor expands it to each tile's `<fake_token_around_image><row_r_col_c>` and
# image_seq_len `<image>` tokens, then the global image's `<global-img>` tokens), `<end_of_utterance>\n` after each
# message, `Assistant:` to prompt the answer.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
