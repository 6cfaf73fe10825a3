//! The drafter's training forward (DeepSpec `Qwen3DSparkModel.forward` /
//! `Gemma4DSparkModel.forward`, `deepspec/modeling/dspark/common.py`; port spec §2.5): many
//! draft blocks of one sequence in one pass, each block seeing exactly what the inference
//! draft call sees.
//!
//! ```text
//! anchors p_1 < .. < p_N        positions p with loss_mask[p] and loss_mask[p+1]
//! C      = hidden_norm(fc(F))   F [L, T*H] target taps of positions 0..L-1
//! X      = embed([x_{p_b}, mask x (B-1)] for each b)            [N*B, H]
//! per layer: Q from X roped at p_b + j; K, V = [ctx rows of C at 0..L-1 ; X rows]
//!            block b's queries see context keys k < p_b and its own B slots (nothing else):
//!            one softmax over [Q K_ctx^T masked ; Q_b K_b^T], so the other blocks' slots,
//!            masked anyway, are never scored
//! h      = norm(X_L); U = lm_head(h); z = U + W2 W1[prev], prev = [x_{p_b}, x_{p_b+1..p_b+B-1}]
//! conf   = proj([h; W1[prev]])                                  (teacher forcing)
//! labels = x_{p_b+1 .. p_b+B}; eval_mask = prefix of labels inside the sequence and the loss mask
//! target = lm_head(target_hidden[p_b + j])                      the target's own next-token logits
//! ```
//!
//! The layers are the drafter's own ([`Drafter`]'s attention, MLP and norms), built from the
//! traced parameters by [`Drafter::from_weights`]; only the rotary embedding is the
//! differentiable [`Rope::apply_positions`] instead of MLX's fused kernel.
//!
//! [`Rope::apply_positions`]: mlx_core::fast::Rope::apply_positions
use mlx_core::{Array, Dtype, concatenate};

use crate::model::Drafter;
use crate::{Error, Result};

/// One training sequence: its tokens and what the target computed on them.
pub struct TrainingSequence<'a> {
    /// Token ids `x_0 .. x_{L-1}` (prompt and answer).
    pub input_ids: &'a [u32],
    /// The target's taps at every position, `[L, T*H]` (the outputs of the decoder layers
    /// `target_layer_ids`, concatenated in that order).
    pub taps: &'a Array,
    /// The target's final-normed last hidden state at every position, `[L, H]`: its logits
    /// through the (frozen, shared) LM head are the teacher distribution.
    pub target_hidden: &'a Array,
    /// Which positions are trained on (`false` on the prompt), length `L`.
    pub loss_mask: &'a [bool],
}

/// What [`Drafter::training_forward`] returns for `N` anchors and block size `B`.
pub struct TrainingOutputs {
    /// Markov-corrected draft logits `z`, `[N, B, K]` (compute dtype; `K` the draft
    /// vocabulary, `V` without a reduced one).
    pub draft_logits: Array,
    /// Confidence logits `[N, B]` (f32), when the drafter has a confidence head.
    pub confidence_logits: Option<Array>,
    /// The target's logits for the same positions over the draft vocabulary, `[N, B, K]` (no
    /// gradient).
    pub target_logits: Array,
    /// Labels `x_{p_b + 1 + j}` as rows of the draft vocabulary, `[N, B]` int32 (clamped to the
    /// last position past the end; 0 where the draft vocabulary lacks the token, which the
    /// eval mask excludes).
    pub target_ids: Array,
    /// 1.0 where slot `j` of block `b` is trained on (a prefix of each block), `[N, B]` f32.
    pub eval_mask: Array,
}

/// Positions that can anchor a block: `p` with `loss_mask[p]` and `loss_mask[p + 1]`
/// (`common.py: build_anchor_candidate_mask`).
pub fn anchor_candidates(loss_mask: &[bool]) -> Vec<usize> {
    (0..loss_mask.len().saturating_sub(1)).filter(|&p| loss_mask[p] && loss_mask[p + 1]).collect()
}

/// Up to `num_anchors` of [`anchor_candidates`], drawn uniformly without replacement and
/// sorted (`common.py: sample_anchor_positions`; DeepSpec pads with dummy anchors that carry
/// no loss, which are simply absent here).
pub fn sample_anchors(loss_mask: &[bool], num_anchors: usize, rng: &mut impl rand::Rng) -> Vec<usize> {
    let candidates = anchor_candidates(loss_mask);
    let mut picked = rand::seq::index::sample(rng, candidates.len(), num_anchors.min(candidates.len()))
        .into_iter()
        .map(|i| candidates[i])
        .collect::<Vec<_>>();
    picked.sort_unstable();
    picked
}

impl Drafter {
    /// The training forward over the blocks anchored at `anchors` (sorted, each `< L - 1`),
    /// all in one pass. Lazy; build the drafter with `KernelPolicy::mlx()` to differentiate.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the shapes of `seq` disagree with each other or the drafter,
    /// an anchor is out of range or out of order, or a token is outside the vocabulary.
    pub fn training_forward(&self, seq: &TrainingSequence<'_>, anchors: &[usize]) -> Result<TrainingOutputs> {
        let c = self.config();
        let (l, b, n) = (seq.input_ids.len(), c.block_size, anchors.len());
        self.check_sequence(seq, anchors)?;
        let ids = seq.input_ids;

        // Labels (rows of the draft vocabulary), the eval mask (a prefix per block, cut at a
        // label the draft vocabulary lacks) and the Markov head's teacher-forced inputs.
        let to_draft: Option<Vec<i32>> = self.draft_vocab_ids().map(|ids| {
            let mut m = vec![-1; c.vocab_size];
            for (row, &t) in ids.iter().enumerate() {
                m[t as usize] = row as i32;
            }
            m
        });
        let mut target_ids = Vec::with_capacity(n * b);
        let mut eval_mask = Vec::with_capacity(n * b);
        let mut prev = Vec::with_capacity(n * b);
        let mut aligned = Vec::with_capacity(n * b);
        for &p in anchors {
            let mut alive = true;
            for j in 0..b {
                let label = p + 1 + j;
                let safe = label.min(l - 1);
                let row = to_draft.as_ref().map_or(ids[safe] as i32, |m| m[ids[safe] as usize]);
                alive &= label < l && seq.loss_mask[safe] && row >= 0;
                target_ids.push(row.max(0));
                eval_mask.push(if alive { 1f32 } else { 0. });
                prev.push(if j == 0 { ids[p] } else { ids[(p + j).min(l - 1)] });
                aligned.push((safe - 1) as i32);
            }
        }

        // The context projection and the block embeddings.
        let context = self.project_context(&seq.taps.expand_dims(&[0])?)?; // [1, L, H]
        let mut block_ids = vec![c.mask_token_id; n * b];
        for (i, &p) in anchors.iter().enumerate() {
            block_ids[i * b] = ids[p];
        }
        let mut x = self.embed_ids(&block_ids)?.expand_dims(&[0])?; // [1, N*B, H]

        // Positions and the context mask.
        let ctx_pos: Vec<i32> = (0..l as i32).collect();
        let block_pos: Vec<i32> = anchors.iter().flat_map(|&p| (0..b).map(move |j| (p + j) as i32)).collect();
        let q_pos = Array::from_slice(&block_pos, &[(n * b) as i32])?;
        let kv_pos = Array::from_slice(&[ctx_pos.as_slice(), &block_pos].concat(), &[(l + n * b) as i32])?;
        let mask = context_mask(anchors, l)?;

        for layer in self.layers() {
            x = layer_training_forward(layer, &x, &context, &q_pos, &kv_pos, &mask, self)?;
        }
        let hidden = self.final_norm(&x)?.reshape(&[(n * b) as i32, -1])?; // [N*B, H]
        let base = self.base_logits(&hidden)?;
        let w1 = self.markov_embed(&prev)?;
        let draft_logits = match (self.markov_w2(), &w1) {
            (Some(w2), Some(w1)) => base.add(&w2.forward(w1)?)?,
            _ => base,
        };
        let confidence_logits = match self.confidence_head() {
            Some(head) => {
                let feats = match (&w1, c.confidence_with_markov) {
                    (Some(w1), true) => concatenate(&[&hidden, w1], -1)?,
                    _ => hidden.clone(),
                };
                Some(head.forward(&feats)?.astype(Dtype::Float32)?.reshape(&[n as i32, b as i32])?)
            }
            None => None,
        };
        let teacher = seq.target_hidden.take(&Array::from_slice(&aligned, &[(n * b) as i32])?, 0)?;
        let target_logits = self.base_logits(&teacher.astype(self.dtype())?)?.stop_gradient()?;
        let shape = [n as i32, b as i32];
        Ok(TrainingOutputs {
            draft_logits: draft_logits.reshape(&[n as i32, b as i32, -1])?,
            confidence_logits,
            target_logits: target_logits.reshape(&[n as i32, b as i32, -1])?,
            target_ids: Array::from_slice(&target_ids, &shape)?,
            eval_mask: Array::from_slice(&eval_mask, &shape)?,
        })
    }

    fn check_sequence(&self, seq: &TrainingSequence<'_>, anchors: &[usize]) -> Result<()> {
        let c = self.config();
        let l = seq.input_ids.len();
        let bad = |m: String| Err(Error::Invalid(format!("training sequence: {m}")));
        if l < 2 {
            return bad(format!("{l} tokens; at least 2 are needed"));
        }
        if seq.loss_mask.len() != l {
            return bad(format!("loss mask of length {} for {l} tokens", seq.loss_mask.len()));
        }
        let (h, w) = (c.hidden_size as i32, c.feature_width() as i32);
        if seq.taps.shape() != [l as i32, w] {
            return bad(format!("taps of shape {:?}, expected [{l}, {w}]", seq.taps.shape()));
        }
        if seq.target_hidden.shape() != [l as i32, h] {
            return bad(format!("target hidden states of shape {:?}, expected [{l}, {h}]", seq.target_hidden.shape()));
        }
        if let Some(t) = seq.input_ids.iter().find(|&&t| t as usize >= c.vocab_size) {
            return bad(format!("token {t} is outside the vocabulary of {}", c.vocab_size));
        }
        if anchors.windows(2).any(|w| w[0] >= w[1]) || anchors.last().is_some_and(|&p| p + 1 >= l) {
            return bad(format!("anchors {anchors:?} must increase and stay below {}", l - 1));
        }
        if anchors.is_empty() {
            return bad("no anchors".into());
        }
        Ok(())
    }
}

/// Which context keys each block sees, `[N, 1, L]` (true = attend; the same for its `B`
/// slots): block `b`'s queries see the context keys `k < p_b` (the context columns of
/// `common.py: create_dspark_attention_mask`; its other columns, the blocks' own slots,
/// [`block_attention`] scores per block instead).
fn context_mask(anchors: &[usize], l: usize) -> Result<Array> {
    let n = anchors.len();
    let mut m = Vec::with_capacity(n * l);
    for &p in anchors {
        m.extend((0..l).map(|k| u8::from(k < p)));
    }
    Ok(Array::from_slice(&m, &[n as i32, 1, l as i32])?.astype(Dtype::Bool)?)
}

/// DeepSpec's masked attention of the training forward (MLX's `scaled_dot_product_attention`
/// fallback with an array mask: `q * scale`, GQA by a repeat axis, `where(mask, s, -inf)`,
/// a precise softmax) without scoring the masked block columns: per block, one softmax over
/// its context scores (masked to `k < p_b`) and its own `B x B` scores.
/// `q [1, nh, N*B, hd]`, `k`/`v [1, nkv, L + N*B, hd]`, `mask` [`context_mask`]'s `[N, 1, L]`
/// -> `[1, nh, N*B, hd]`.
fn block_attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Result<Array> {
    let (&[_, nh, rows, hd], &[n, _, l]) = (q.shape().as_slice(), mask.shape().as_slice()) else {
        return Err(Error::Invalid(format!("block queries {:?} and context mask {:?}", q.shape(), mask.shape())));
    };
    let b = rows / n;
    let nkv = k.shape()[1];
    let rep = nh / nkv;
    let q = q.multiply(&Array::scalar_as(f64::from(scale), q.dtype())?)?.reshape(&[1, nkv, rep, n, b, hd])?;
    let kc = k.slice_axis(2, 0, l)?.reshape(&[1, nkv, 1, 1, l, hd])?;
    let vc = v.slice_axis(2, 0, l)?.reshape(&[1, nkv, 1, 1, l, hd])?;
    let kb = k.slice_axis(2, l, l + rows)?.reshape(&[1, nkv, 1, n, b, hd])?;
    let vb = v.slice_axis(2, l, l + rows)?.reshape(&[1, nkv, 1, n, b, hd])?;
    let q_ctx = q.reshape(&[1, nkv, rep, 1, rows, hd])?;
    let ctx = q_ctx.matmul(&kc.swapaxes(-1, -2)?)?.reshape(&[1, nkv, rep, n, b, l])?;
    let ctx = mask.where_(&ctx, &Array::scalar_as(f64::NEG_INFINITY, ctx.dtype())?)?;
    let own = q.matmul(&kb.swapaxes(-1, -2)?)?; // [1, nkv, rep, N, B, B]
    let w = concatenate(&[&ctx, &own], -1)?.softmax(&[-1], true)?;
    let parts = w.split_at(&[l], -1)?;
    let out = parts[0]
        .reshape(&[1, nkv, rep, 1, rows, l])?
        .matmul(&vc)?
        .reshape(&[1, nkv, rep, n, b, hd])?
        .add(&parts[1].matmul(&vb)?)?;
    Ok(out.reshape(&[1, nh, rows, hd])?)
}

/// One draft layer's training forward: `x [1, N*B, H]` block rows, `context [1, L, H]`.
pub(crate) fn layer_training_forward(
    layer: &crate::model::Layer,
    x: &Array,
    context: &Array,
    q_pos: &Array,
    kv_pos: &Array,
    mask: &Array,
    d: &Drafter,
) -> Result<Array> {
    let a = &layer.attn;
    let rows = x.shape()[1];
    let l = context.shape()[1];
    let xn = layer.input_layernorm.forward(x)?;
    let heads = |y: &Array, n: i32, len: i32, norm: Option<&models::layers::RmsNorm>| -> Result<Array> {
        let y = y.reshape(&[1, len, n, a.head_dim])?;
        let y = match norm {
            Some(nrm) => nrm.forward(&y)?,
            None => y,
        };
        Ok(y.transpose(&[0, 2, 1, 3])?)
    };
    let rope = d.rope();
    let q = rope.apply_positions(&heads(&a.q_proj.forward(&xn)?, a.n_heads, rows, a.q_norm.as_ref())?, q_pos)?;
    let kv_in = concatenate(&[context, &xn], 1)?; // [1, L + N*B, H]
    let k_proj = a.k_proj.as_ref().ok_or_else(|| Error::Invalid("a draft layer without k_proj".into()))?;
    let k_raw = k_proj.forward(&kv_in)?;
    let k = rope.apply_positions(&heads(&k_raw, a.n_kv_heads, l + rows, a.k_norm.as_ref())?, kv_pos)?;
    let v_raw = match &a.v_proj {
        Some(v) => v.forward(&kv_in)?,
        None => k_raw,
    };
    let v = v_raw.reshape(&[1, l + rows, a.n_kv_heads, a.head_dim])?;
    let v = match a.v_norm_eps {
        Some(eps) => mlx_core::fast::rms_norm(&v, None, eps, a.kernels())?,
        None => v,
    };
    let v = v.transpose(&[0, 2, 1, 3])?;
    let o = block_attention(&q, &k, &v, a.scale, mask)?;
    let o = a.o_proj.forward(&o.transpose(&[0, 2, 1, 3])?.reshape(&[1, rows, -1])?)?;
    layer.residual_and_mlp(x, &o)
}
