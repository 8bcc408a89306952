"""
The LM loss in chunks of rows: sum_i cross_entropy(x_i @ W.T + b, target_i), in float32, never holding the
(rows, vocab) logits (at 32k CLM rows and V = 50368: 6.6 GB in float32, which autograd would keep and then double
with their gradient).

The loss is the last op of the step, so its gradient with respect to a chunk's logits, softmax - onehot, is known
as soon as the chunk's forward is: forward computes each chunk's gradients right away and drops its logits, and
backward only scales them by the incoming scalar (Liger-Kernel's fused linear cross-entropy, in torch ops; unlike
checkpointing each chunk it recomputes nothing). 2048 rows per chunk: 394 MiB of float32 logits at V = 50368, and a
(2048 x 768) @ (768 x V) matmul still keeps the tensor cores busy.
"""

import torch
import torch.nn.functional as F

CHUNK_ROWS = 2048


def chunked_cross_entropy(x, weight, bias, targets, chunk_rows=CHUNK_ROWS, max_rows=None):
    """x: (N, H) inputs of the decoder, targets: (N,) -> the float32 sum of the N cross-entropies of
    F.linear(x, weight, bias), as cross_entropy(logits.float(), targets, reduction="sum") gives it.

    max_rows, a bound on N that does not change between steps (the batch's token count), fixes the number of
    chunks: under torch.compile the loop then has a fixed length and N stays symbolic, so an MLM step with
    another number of masked tokens reuses the graph. Gradients are computed only where autograd will ask for
    them (not under torch.no_grad)."""
    n_chunks = max(1, -(-(max_rows or x.shape[0]) // chunk_rows))
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(x, weight, bias, targets, n_chunks, want_grad)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The rows are padded to n_chunks equal chunks with ignored targets; one chunk's (rows, V) logits and their
    gradient exist at a time."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, n_chunks, want_grad):
        N = x.shape[0]
        chunk = -(-N // n_chunks)
        pad = n_chunks * chunk - N
        x, targets = F.pad(x, (0, 0, 0, pad)), F.pad(targets, (0, pad), value=-100)  # (n_chunks * chunk, ...)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        if want_grad:  # accumulated in float32 whatever the matmul dtype, cast to the inputs' dtype in backward
            grad_x = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32)
        for i in range(n_chunks):
            xc, yc = x[i * chunk:(i + 1) * chunk], targets[i * chunk:(i + 1) * chunk]  # (c, H), (c,)
            valid = yc >= 0  # (c,) False on the padding rows
            yc = yc.clamp_min(0)
            logits = F.linear(xc, weight, bias)  # (c, V), in autocast's dtype under autocast
            mm_dtype = logits.dtype
            logits = logits.float()  # the softmax in float32, as F.cross_entropy(logits.float()) would
            lse = logits.logsumexp(dim=-1)  # (c,)
            # Out of place: the tensor forward returns must not be one it updated in place, or torch 2.11's
            # dynamo hands backward a zero gradient for it (pytorch#180642): every gradient zero, compiled.
            loss = loss + ((lse - logits.gather(1, yc[:, None]).squeeze(1)) * valid).sum()
            if want_grad:
                grad = logits.sub_(lse[:, None]).exp_()  # (c, V) softmax, written over the logits
                grad.scatter_add_(1, yc[:, None], -valid[:, None].float())  # - onehot
                grad.mul_(valid[:, None])  # padding rows: no gradient
                grad = grad.to(mm_dtype)  # cast once for the three matmuls (which autocast runs in mm_dtype)
                # The bias gradient, a column sum, as a matrix product (rounded as the other two are): compiled, the
                # chunks' column sums fused into one slow kernel after the last chunk that kept every chunk's
                # gradient alive (H200, CLM at 4 x 8192: 8.8 ms of a 122 ms step).
                grad_b += valid.to(mm_dtype) @ grad  # (c,) @ (c, V)
                grad_x[i * chunk:(i + 1) * chunk] = grad @ weight  # (c, V) @ (V, H)
                grad_w += grad.T @ xc  # (V, c) @ (c, H)
        if want_grad:
            ctx.save_for_backward(grad_x[:N], grad_w, grad_b)
            ctx.dtypes = x.dtype, weight.dtype, bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """d(grad_loss * loss) / d(x, weight, bias): the forward's gradients scaled by the upstream scalar."""
        return (*((g * grad_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)), None, None, None)
