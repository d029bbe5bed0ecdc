//! The forward pass's mixture-of-experts MLP ([`crate::arch::moe`] is its
//! description).
//!
//! A batch's rows are routed, then **grouped by expert**: each expert that
//! any row chose multiplies all of its rows in one projection call, so a
//! step reads each chosen expert's weights once however many rows chose
//! it (a 16-sequence decode step reads at most 16 x top_k experts' worth,
//! usually far fewer, instead of a pass per row). Row `r`'s output is then
//! summed over its chosen experts in its own routing order (slot 0 first),
//! from a buffer that keeps each (row, slot) result apart: the sum does not
//! depend on which other rows shared the step, so the output is as
//! independent of batching as the projections themselves are.
//!
//! Cost per token: the router (`experts x hidden`), `top_k` experts and the
//! shared expert; the gather and scatter copies are `2 x top_k x hidden`
//! floats per row, small beside any expert's weights.

use crate::arch::moe::{GroupScore, Groups, Moe, Scoring};
use crate::arch::Activation;
use crate::error::{ModelError, Result};
use crate::linear::Projection;
use crate::llama::gated_rows;
use crate::weights::{Mlp, MoeWeights};

/// One gated MLP as the pass runs it: gate and up stacked into one
/// projection, then down; biases added to each projection's rows where the
/// MLP has them (gpt-oss's experts).
#[derive(Debug)]
pub(crate) struct MlpRt {
    gate_up: Projection,
    down: Projection,
    ff: usize,
    /// `[gate bias | up bias]`, as the stacked projection lays out a row.
    gate_up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
}

impl MlpRt {
    pub(crate) fn new(m: &Mlp) -> Result<Self> {
        Ok(Self {
            gate_up: Projection::new(&[&m.gate, &m.up])?,
            down: Projection::new(&[&m.down])?,
            ff: m.gate.shape().0,
            gate_up_bias: m.bias.as_ref().map(|b| [&b.gate[..], &b.up[..]].concat()),
            down_bias: m.bias.as_ref().map(|b| b.down.clone()),
        })
    }

    /// `x [rows, hidden]` through the MLP into `out [rows, hidden]`;
    /// `stacked` and `gate` are scratch.
    pub(crate) fn apply(
        &self,
        act: Activation,
        x: &[f32],
        rows: usize,
        out: &mut Vec<f32>,
        stacked: &mut Vec<f32>,
        gate: &mut Vec<f32>,
    ) -> Result<()> {
        // `act(gate) * up` straight from the stacked projection's rows.
        self.gate_up.apply_stacked(x, rows, stacked)?;
        add_rows(
            &mut stacked[..rows * 2 * self.ff],
            self.gate_up_bias.as_deref(),
        );
        gate.resize(rows * self.ff, 0.0);
        gated_rows(act, stacked, self.ff, gate);
        self.down
            .apply_into(gate, rows, &mut [&mut *out], stacked)?;
        add_rows(out, self.down_bias.as_deref());
        Ok(())
    }

    pub(crate) fn projections(&self) -> [&Projection; 2] {
        [&self.gate_up, &self.down]
    }
}

/// A sparse layer's router and experts.
#[derive(Debug)]
pub(crate) struct MoeRt {
    router: Projection,
    /// Added to the router's logits (gpt-oss).
    logit_bias: Option<Vec<f32>>,
    experts: Vec<MlpRt>,
    shared: Option<MlpRt>,
    shared_gate: Option<Vec<f32>>,
    routing: Routing,
}

/// How a row's router logits choose and weight its experts
/// ([`crate::arch::moe`]'s module docs).
#[derive(Debug)]
struct Routing {
    top_k: usize,
    norm_top_k: bool,
    scoring: Scoring,
    bias: Option<Vec<f32>>,
    groups: Option<Groups>,
    scale: f32,
}

/// Buffers of the MoE MLP, kept between passes with the rest of the
/// workspace.
#[derive(Default)]
pub(crate) struct MoeScratch {
    logits: Vec<f32>,
    /// `(expert, weight)` for each row's slots, `rows x top_k`.
    choice: Vec<(usize, f32)>,
    /// The (row, slot) indices routed to the expert being run.
    members: Vec<usize>,
    gathered: Vec<f32>,
    expert_out: Vec<f32>,
    /// Each (row, slot)'s expert output, `rows x top_k x hidden`.
    slots: Vec<f32>,
    gate: Vec<f32>,
}

impl MoeScratch {
    pub(crate) fn floats(&self) -> usize {
        [
            &self.logits,
            &self.gathered,
            &self.expert_out,
            &self.slots,
            &self.gate,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum()
    }
}

impl MoeRt {
    pub(crate) fn new(w: &MoeWeights, moe: &Moe) -> Result<Self> {
        if w.experts.len() != moe.n_experts {
            return Err(ModelError::Compute {
                detail: format!(
                    "{} experts loaded for a configuration of {}",
                    w.experts.len(),
                    moe.n_experts
                ),
            });
        }
        Ok(Self {
            router: Projection::new(&[&w.router])?,
            logit_bias: w.logit_bias.clone(),
            experts: w.experts.iter().map(MlpRt::new).collect::<Result<_>>()?,
            shared: w.shared.as_ref().map(MlpRt::new).transpose()?,
            shared_gate: w.shared_gate.clone(),
            routing: Routing {
                top_k: moe.top_k,
                norm_top_k: moe.norm_top_k,
                scoring: moe.scoring,
                bias: w.router_bias.clone(),
                groups: moe.groups,
                scale: moe.routed_scale,
            },
        })
    }

    /// Whether the experts run through the quantized kernels.
    pub(crate) fn is_quantized(&self) -> bool {
        self.experts
            .iter()
            .any(|e| e.gate_up.is_quantized() || e.down.is_quantized())
    }

    /// `(bytes, multiply-adds)` of weights one token reads: the router, the
    /// shared expert, and `top_k` experts (of average size).
    pub(crate) fn active_per_token(&self) -> (usize, usize) {
        let mut bytes = self.router.weight_bytes();
        let mut params = self.router.params();
        for p in self.shared.iter().flat_map(MlpRt::projections) {
            bytes += p.weight_bytes();
            params += p.params();
        }
        let (eb, ep) = self
            .experts
            .iter()
            .flat_map(MlpRt::projections)
            .fold((0, 0), |(b, p), pr| {
                (b + pr.weight_bytes(), p + pr.params())
            });
        let (n, k) = (self.experts.len().max(1), self.routing.top_k);
        (bytes + eb * k / n, params + ep * k / n)
    }

    /// `xn [rows, hidden]` (the normed residual) through the router, the
    /// chosen experts and the shared expert into `out [rows, hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply(
        &self,
        act: Activation,
        xn: &[f32],
        rows: usize,
        hidden: usize,
        out: &mut Vec<f32>,
        stacked: &mut Vec<f32>,
        s: &mut MoeScratch,
    ) -> Result<()> {
        let (n_experts, k) = (self.experts.len(), self.routing.top_k);
        self.router
            .apply_into(xn, rows, &mut [&mut s.logits], stacked)?;
        add_rows(&mut s.logits, self.logit_bias.as_deref());
        s.choice.clear();
        for logits in s.logits.chunks_exact(n_experts) {
            self.routing.route(logits, &mut s.choice);
        }

        s.slots.clear();
        s.slots.resize(rows * k * hidden, 0.0);
        for (e, expert) in self.experts.iter().enumerate() {
            s.members.clear();
            s.members.extend(
                s.choice
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.0 == e)
                    .map(|(i, _)| i),
            );
            if s.members.is_empty() {
                continue;
            }
            s.gathered.clear();
            for &i in &s.members {
                let r = i / k;
                s.gathered
                    .extend_from_slice(&xn[r * hidden..(r + 1) * hidden]);
            }
            expert.apply(
                act,
                &s.gathered,
                s.members.len(),
                &mut s.expert_out,
                stacked,
                &mut s.gate,
            )?;
            for (m, &i) in s.members.iter().enumerate() {
                s.slots[i * hidden..(i + 1) * hidden]
                    .copy_from_slice(&s.expert_out[m * hidden..(m + 1) * hidden]);
            }
        }

        out.clear();
        out.resize(rows * hidden, 0.0);
        for (r, row) in out.chunks_exact_mut(hidden).enumerate() {
            for slot in 0..k {
                let i = r * k + slot;
                let w = s.choice[i].1;
                let y = &s.slots[i * hidden..(i + 1) * hidden];
                row.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
        }

        if let Some(shared) = &self.shared {
            shared.apply(act, xn, rows, &mut s.expert_out, stacked, &mut s.gate)?;
            for (r, row) in out.chunks_exact_mut(hidden).enumerate() {
                let x = &xn[r * hidden..(r + 1) * hidden];
                let g = match &self.shared_gate {
                    Some(w) => sigmoid(dot(w, x)),
                    None => 1.0,
                };
                let y = &s.expert_out[r * hidden..(r + 1) * hidden];
                row.iter_mut().zip(y).for_each(|(o, y)| *o += g * y);
            }
        }
        Ok(())
    }
}

impl Routing {
    /// A row's `top_k` experts with their weights, appended to `out` best
    /// first: scores (softmax or sigmoid of the logits); the choice by
    /// score plus the correction bias, within the best groups where
    /// experts are grouped (a group's strength: its two best summed, or
    /// its best, [`GroupScore`]), ties to the
    /// lower index (a stable sort); the weights the chosen scores,
    /// renormalised when `norm_top_k`, times `scale`. With
    /// [`Scoring::TopKSoftmax`] the scores are the logits themselves and the
    /// weights the softmax over the chosen ones. NaN logits (a broken
    /// model) give NaN weights, never a panic.
    fn route(&self, logits: &[f32], out: &mut Vec<(usize, f32)>) {
        let n = logits.len();
        let scores: Vec<f32> = match self.scoring {
            Scoring::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f32 = exp.iter().sum();
                exp.iter().map(|e| e / total).collect()
            }
            Scoring::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
            Scoring::TopKSoftmax => logits.to_vec(),
        };
        let mut choice: Vec<f32> = match &self.bias {
            Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        if let Some(g) = self.groups {
            let per = n / g.n_group;
            let taken = match g.score {
                GroupScore::TopTwoSum => 2,
                GroupScore::Max => 1,
            };
            let strength: Vec<f32> = choice
                .chunks(per)
                .map(|grp| {
                    let mut best = grp.to_vec();
                    best.sort_by(|a, b| b.total_cmp(a));
                    best.iter().take(taken).sum()
                })
                .collect();
            let mut order: Vec<usize> = (0..g.n_group).collect();
            order.sort_by(|&a, &b| strength[b].total_cmp(&strength[a]));
            for &dropped in &order[g.topk_group.min(order.len())..] {
                choice[dropped * per..(dropped + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
        let chosen = &order[..self.top_k.min(n)];
        if self.scoring == Scoring::TopKSoftmax {
            // `order` is best first: the first chosen has the maximum.
            let max = chosen.first().map_or(0.0, |&e| scores[e]);
            let exp: Vec<f32> = chosen.iter().map(|&e| (scores[e] - max).exp()).collect();
            let total: f32 = exp.iter().sum();
            for (&e, x) in chosen.iter().zip(&exp) {
                out.push((e, x / total * self.scale));
            }
            return;
        }
        // transformers adds 1e-20 to the sum (a no-op for any sum of
        // normal floats).
        let sum: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
        for &e in chosen {
            let w = if self.norm_top_k {
                scores[e] / sum
            } else {
                scores[e]
            };
            out.push((e, w * self.scale));
        }
    }
}

/// `bias` added to every row of `x` (rows of `bias.len()` values), where
/// there is one.
fn add_rows(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::{GroupScore, Groups, Routing, Scoring};

    fn softmax(top_k: usize, norm_top_k: bool) -> Routing {
        Routing {
            top_k,
            norm_top_k,
            scoring: Scoring::Softmax,
            bias: None,
            groups: None,
            scale: 1.0,
        }
    }

    #[test]
    fn routing_picks_the_top_k_by_probability_and_renormalises_when_asked() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let mut out = Vec::new();
        softmax(2, false).route(&logits, &mut out);
        let exp: Vec<f32> = logits.iter().map(|l| (l - 2.0f32).exp()).collect();
        let total: f32 = exp.iter().sum();
        assert_eq!(out[0].0, 1);
        assert_eq!(out[1].0, 3);
        assert!((out[0].1 - exp[1] / total).abs() < 1e-6);
        assert!((out[1].1 - exp[3] / total).abs() < 1e-6);
        let mut normed = Vec::new();
        softmax(2, true).route(&logits, &mut normed);
        assert!((normed[0].1 + normed[1].1 - 1.0).abs() < 1e-6);
        assert!((normed[0].1 / normed[1].1 - exp[1] / exp[3]).abs() < 1e-4);
    }

    /// gpt-oss: chosen by logit, weighted by the softmax over the chosen
    /// logits alone (not over every expert), whatever `norm_top_k` says.
    #[test]
    fn top_k_softmax_weighs_the_chosen_logits_alone() {
        let r = Routing {
            top_k: 2,
            norm_top_k: false,
            scoring: Scoring::TopKSoftmax,
            bias: None,
            groups: None,
            scale: 1.0,
        };
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        let mut out = Vec::new();
        r.route(&logits, &mut out);
        assert_eq!((out[0].0, out[1].0), (1, 3));
        let (a, b) = (1.0f32, (-1.0f32).exp());
        assert!((out[0].1 - a / (a + b)).abs() < 1e-6);
        assert!((out[1].1 - b / (a + b)).abs() < 1e-6);
        out.clear();
        Routing { top_k: 1, ..r }.route(&[f32::NAN, 0.0, 1.0], &mut out);
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn ties_go_to_the_lower_expert_and_nan_never_panics() {
        let mut out = Vec::new();
        softmax(2, true).route(&[1.0, 1.0, 1.0], &mut out);
        assert_eq!((out[0].0, out[1].0), (0, 1));
        out.clear();
        softmax(1, true).route(&[f32::NAN, 0.0, 1.0], &mut out);
        assert_eq!(out.len(), 1);
    }

    /// Sigmoid scores choose by score plus bias but weigh by score, within
    /// the kept group, scaled.
    #[test]
    fn biased_grouped_sigmoid_routing_chooses_and_weighs_apart() {
        let r = Routing {
            top_k: 2,
            norm_top_k: true,
            scoring: Scoring::Sigmoid,
            // Lifts expert 2 into the choice, not into its weight.
            bias: Some(vec![0.0, 0.0, 0.5, 0.0, 0.0, 0.0]),
            groups: Some(Groups {
                n_group: 2,
                topk_group: 1,
                score: GroupScore::TopTwoSum,
            }),
            scale: 2.5,
        };
        // Group 0 (experts 0-2) with the bias outscores group 1, though
        // expert 4 alone has the highest logit.
        let logits = [1.0f32, -2.0, 0.2, -3.0, 1.5, -3.0];
        let mut out = Vec::new();
        r.route(&logits, &mut out);
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Expert 2 first by score plus bias (1.05 against 0.73).
        assert_eq!((out[0].0, out[1].0), (2, 0));
        let sum = sig(1.0) + sig(0.2);
        assert!((out[0].1 - 2.5 * sig(0.2) / sum).abs() < 1e-6);
        assert!((out[1].1 - 2.5 * sig(1.0) / sum).abs() < 1e-6);
    }

    /// DeepSeek V2's `group_limited_greedy`: softmax scores, a group
    /// scored by its best expert, the best groups kept, then the top-k of
    /// those, not renormalised, scaled. The same logits scored by a
    /// group's two best keep another group, and choose another expert.
    #[test]
    fn v2_groups_are_scored_by_their_best_expert() {
        let r = Routing {
            top_k: 2,
            norm_top_k: false,
            scoring: Scoring::Softmax,
            bias: None,
            groups: Some(Groups {
                n_group: 3,
                topk_group: 2,
                score: GroupScore::Max,
            }),
            scale: 2.0,
        };
        // Groups (0, 1), (2, 3), (4, 5). Probabilities (hand-computed):
        // 0.30720, 0.00028 | 0.18632, 0.16859 | 0.17724, 0.16037; a
        // group's best: 0.307, 0.186, 0.177 (groups 0 and 1 kept); its
        // two best: 0.307, 0.355, 0.338 (groups 1 and 2 kept).
        let logits = [3.0f32, -4.0, 2.5, 2.4, 2.45, 2.35];
        let mut out = Vec::new();
        r.route(&logits, &mut out);
        // The best two of experts 0-3: 0 and 2, weighted 2 p.
        assert_eq!((out[0].0, out[1].0), (0, 2));
        assert!((out[0].1 - 2.0 * 0.307_196).abs() < 1e-5, "{out:?}");
        assert!((out[1].1 - 2.0 * 0.186_324).abs() < 1e-5, "{out:?}");

        // Scored by the two best, group 0 drops out: experts 2 and 4.
        let sum2 = Routing {
            groups: Some(Groups {
                n_group: 3,
                topk_group: 2,
                score: GroupScore::TopTwoSum,
            }),
            ..r
        };
        out.clear();
        sum2.route(&logits, &mut out);
        assert_eq!((out[0].0, out[1].0), (2, 4));
        assert!((out[1].1 - 2.0 * 0.177_237).abs() < 1e-5, "{out:?}");
    }
}
