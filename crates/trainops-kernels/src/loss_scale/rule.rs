//! Dynamic loss scaling, as PyTorch's `GradScaler` and Keras 3's `LossScaleOptimizer` do it.

/// The rule's parameters (defaults: PyTorch's and Keras 3's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleRule {
    /// Finite steps in a row after which the scale grows.
    pub growth_interval: i64,
    /// Factor the scale grows by.
    pub growth_factor: f32,
    /// Factor the scale shrinks by after a non-finite step.
    pub backoff_factor: f32,
    /// The scale never backs off below this.
    pub min_scale: f32,
}

impl Default for LossScaleRule {
    fn default() -> Self {
        Self { growth_interval: 2000, growth_factor: 2.0, backoff_factor: 0.5, min_scale: 0.0 }
    }
}

impl LossScaleRule {
    /// The next `(scale, good_steps)` after a step whose gradients were `finite` or not.
    ///
    /// Finite: after `growth_interval` finite steps in a row the scale grows (unless that
    /// would overflow to infinity, when it stays) and the count restarts; else the count
    /// goes up by one. Not finite: `max(scale * backoff_factor, min_scale)`, count 0.
    pub fn next(&self, scale: f32, good_steps: i64, finite: bool) -> (f32, i64) {
        if !finite {
            return ((scale * self.backoff_factor).max(self.min_scale), 0);
        }
        let steps = good_steps.saturating_add(1);
        if steps == self.growth_interval {
            let grown = scale * self.growth_factor;
            (if grown.is_finite() { grown } else { scale }, 0)
        } else {
            (scale, steps)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_after_the_interval_backs_off_on_overflow() {
        let r = LossScaleRule { growth_interval: 3, ..LossScaleRule::default() };
        assert_eq!(r.next(1024.0, 0, true), (1024.0, 1));
        assert_eq!(r.next(1024.0, 1, true), (1024.0, 2));
        assert_eq!(r.next(1024.0, 2, true), (2048.0, 0));
        assert_eq!(r.next(1024.0, 2, false), (512.0, 0));
        assert_eq!(r.next(f32::MAX, 2, true), (f32::MAX, 0));
        let floor = LossScaleRule { min_scale: 600.0, ..r };
        assert_eq!(floor.next(1024.0, 1, false), (600.0, 0));
        assert_eq!(LossScaleRule::default().next(65536.0, 1999, true), (131072.0, 0));
    }
}
