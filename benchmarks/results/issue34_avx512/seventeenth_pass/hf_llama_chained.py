import torch, transformers
from lightning_comp import PrecisionPlan
from lightning_comp.execution import PlanExecutor, StepKind
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg)
print(type(m.model.layers[0].mlp.act_fn))
ex = PlanExecutor(); ex.apply(m, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
x = torch.randint(0, 64, (2, 16))
for _ in range(3):
    with ex.step(StepKind.TRAIN):
        out = m(input_ids=x, labels=x)
    out.loss.backward()
print(sorted(n for n in ex.chained_operators(StepKind.TRAIN) if ".0." in n))
