//! The free gaps of the simulated VA window: a treap ordered by start address
//! whose nodes know the longest gap in their subtree, so the lowest gap of at
//! least n bytes is found in O(log n) (a linear first-fit scan made every
//! `cuMemAlloc` of the `native` policy O(live allocations)).

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    start: u64,
    end: u64,
    /// Longest gap (`end - start`) in this subtree.
    max_len: u64,
    prio: u32,
    left: u32,
    right: u32,
}

/// Disjoint, non-empty ranges `[start, end)` keyed by start.
#[derive(Debug, Clone)]
pub(super) struct Gaps {
    nodes: Vec<Node>,
    vacant: Vec<u32>,
    root: u32,
    /// xorshift state for priorities (deterministic).
    seed: u64,
    /// Scratch: the nodes on the last search path, root first.
    path: Vec<u32>,
}

impl Gaps {
    /// One gap covering `[start, end)`.
    pub fn new(start: u64, end: u64) -> Gaps {
        let mut g = Gaps {
            nodes: Vec::new(),
            vacant: Vec::new(),
            root: NIL,
            seed: 0x9e37_79b9_7f4a_7c15,
            path: Vec::new(),
        };
        if start < end {
            g.insert(start, end);
        }
        g
    }

    fn node(&self, t: u32) -> &Node {
        &self.nodes[t as usize]
    }

    fn node_mut(&mut self, t: u32) -> &mut Node {
        &mut self.nodes[t as usize]
    }

    fn max_len(&self, t: u32) -> u64 {
        if t == NIL {
            0
        } else {
            self.node(t).max_len
        }
    }

    /// Recomputes `max_len` of `t` from its children.
    fn pull(&mut self, t: u32) {
        let (l, r) = (self.node(t).left, self.node(t).right);
        let m = self.max_len(l).max(self.max_len(r));
        let n = self.node_mut(t);
        n.max_len = m.max(n.end - n.start);
    }

    fn new_node(&mut self, start: u64, end: u64) -> u32 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let n = Node {
            start,
            end,
            max_len: end - start,
            prio: (self.seed >> 32) as u32,
            left: NIL,
            right: NIL,
        };
        match self.vacant.pop() {
            Some(t) => {
                self.nodes[t as usize] = n;
                t
            }
            None => {
                self.nodes.push(n);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Splits `t` into (starts < key, starts >= key).
    fn split(&mut self, t: u32, key: u64) -> (u32, u32) {
        if t == NIL {
            return (NIL, NIL);
        }
        if self.node(t).start < key {
            let (a, b) = self.split(self.node(t).right, key);
            self.node_mut(t).right = a;
            self.pull(t);
            (t, b)
        } else {
            let (a, b) = self.split(self.node(t).left, key);
            self.node_mut(t).left = b;
            self.pull(t);
            (a, t)
        }
    }

    /// Joins `a` and `b`, every start in `a` below every start in `b`.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        if a == NIL {
            return b;
        }
        if b == NIL {
            return a;
        }
        if self.node(a).prio >= self.node(b).prio {
            let r = self.merge(self.node(a).right, b);
            self.node_mut(a).right = r;
            self.pull(a);
            a
        } else {
            let l = self.merge(a, self.node(b).left);
            self.node_mut(b).left = l;
            self.pull(b);
            b
        }
    }

    fn insert_at(&mut self, t: u32, n: u32) -> u32 {
        if t == NIL {
            return n;
        }
        if self.node(n).prio > self.node(t).prio {
            let (l, r) = self.split(t, self.node(n).start);
            let nn = self.node_mut(n);
            nn.left = l;
            nn.right = r;
            self.pull(n);
            return n;
        }
        if self.node(n).start < self.node(t).start {
            let l = self.insert_at(self.node(t).left, n);
            self.node_mut(t).left = l;
        } else {
            let r = self.insert_at(self.node(t).right, n);
            self.node_mut(t).right = r;
        }
        self.pull(t);
        t
    }

    /// Adds the gap `[start, end)` (non-empty, disjoint from the others).
    pub fn insert(&mut self, start: u64, end: u64) {
        debug_assert!(start < end);
        let n = self.new_node(start, end);
        self.root = self.insert_at(self.root, n);
    }

    /// Walks from the root towards `key`, recording the path; returns the
    /// path positions of the gap with the greatest start <= `key` and of the
    /// gap with the smallest start > `key`.
    fn search(&mut self, key: u64) -> (Option<usize>, Option<usize>) {
        self.path.clear();
        let (mut le, mut gt) = (None, None);
        let mut t = self.root;
        while t != NIL {
            self.path.push(t);
            let n = &self.nodes[t as usize];
            if n.start <= key {
                le = Some(self.path.len() - 1);
                t = n.right;
            } else {
                gt = Some(self.path.len() - 1);
                t = n.left;
            }
        }
        (le, gt)
    }

    /// Recomputes `max_len` of the path's nodes from position `i` up to the
    /// root, stopping where it no longer changes (the ancestors' then holds).
    fn repull(&mut self, i: usize) {
        for k in (0..=i).rev() {
            let t = self.path[k];
            let old = self.node(t).max_len;
            self.pull(t);
            if self.node(t).max_len == old {
                break;
            }
        }
    }

    /// Sets the gap at path position `i` to `[start, end)` (same place in the order).
    fn set_at(&mut self, i: usize, start: u64, end: u64) {
        let n = self.node_mut(self.path[i]);
        n.start = start;
        n.end = end;
        self.repull(i);
    }

    /// Removes the gap at path position `i`.
    fn remove_at_path(&mut self, i: usize) {
        let t = self.path[i];
        let (l, r) = (self.node(t).left, self.node(t).right);
        let m = self.merge(l, r);
        self.vacant.push(t);
        if i == 0 {
            self.root = m;
        } else {
            let parent = self.path[i - 1];
            let p = self.node_mut(parent);
            if p.left == t {
                p.left = m;
            } else {
                p.right = m;
            }
            self.repull(i - 1);
        }
    }

    /// Adds the gap `[start, end)` (absent) where the last `search(start)`
    /// ended, then rotates it up to its place in the heap: no second descent.
    fn insert_at_search(&mut self, start: u64, end: u64) {
        let n = self.new_node(start, end);
        let mut k = self.path.len();
        if k == 0 {
            self.root = n;
            return;
        }
        let p = self.path[k - 1];
        if start < self.node(p).start {
            self.node_mut(p).left = n;
        } else {
            self.node_mut(p).right = n;
        }
        while k > 0 {
            let p = self.path[k - 1];
            if self.node(n).prio <= self.node(p).prio {
                break;
            }
            // Rotate n above its parent p.
            if self.node(p).left == n {
                let c = self.node(n).right;
                self.node_mut(p).left = c;
                self.node_mut(n).right = p;
            } else {
                let c = self.node(n).left;
                self.node_mut(p).right = c;
                self.node_mut(n).left = p;
            }
            self.pull(p);
            if k >= 2 {
                let g = self.path[k - 2];
                if self.node(g).left == p {
                    self.node_mut(g).left = n;
                } else {
                    self.node_mut(g).right = n;
                }
            } else {
                self.root = n;
            }
            k -= 1;
        }
        self.pull(n);
        self.path.truncate(k);
        self.path.push(n);
        if k > 0 {
            self.repull(k - 1);
        }
    }

    /// Takes `[start, end)` out of the gap that holds it; false (and no
    /// change) if no single gap holds it.
    pub fn carve(&mut self, start: u64, end: u64) -> bool {
        let (Some(i), _) = self.search(start) else {
            return false;
        };
        let (gs, ge) = {
            let n = self.node(self.path[i]);
            (n.start, n.end)
        };
        if ge < end {
            return false;
        }
        match (gs == start, ge == end) {
            (true, true) => self.remove_at_path(i),
            (true, false) => self.set_at(i, end, ge),
            (false, true) => self.set_at(i, gs, start),
            (false, false) => {
                self.set_at(i, gs, start);
                self.search(end);
                self.insert_at_search(end, ge);
            }
        }
        true
    }

    /// Gives back `[start, end)` (lying between gaps), merging it with the
    /// gaps that touch it.
    pub fn release(&mut self, start: u64, end: u64) {
        let (le, gt) = self.search(start);
        let before = le.filter(|&i| self.node(self.path[i]).end == start);
        let after = gt.filter(|&i| self.node(self.path[i]).start == end);
        match (before, after) {
            (Some(_), Some(i)) => {
                let ae = self.node(self.path[i]).end;
                self.remove_at_path(i);
                let (Some(b), _) = self.search(start) else {
                    unreachable!("the gap before is still there")
                };
                let bs = self.node(self.path[b]).start;
                self.set_at(b, bs, ae);
            }
            (Some(b), None) => {
                let bs = self.node(self.path[b]).start;
                self.set_at(b, bs, end);
            }
            (None, Some(a)) => {
                let ae = self.node(self.path[a]).end;
                self.set_at(a, start, ae);
            }
            (None, None) => self.insert_at_search(start, end),
        }
    }

    /// The gap with the greatest start.
    pub fn last(&self) -> Option<(u64, u64)> {
        let mut t = self.root;
        let mut best = None;
        while t != NIL {
            let n = self.node(t);
            best = Some((n.start, n.end));
            t = n.right;
        }
        best
    }

    fn first_fit_at(&self, t: u32, after: Option<u64>, need: u64) -> Option<(u64, u64)> {
        if t == NIL || self.node(t).max_len < need {
            return None;
        }
        let n = self.node(t);
        if after.is_none_or(|a| n.start > a) {
            if let Some(g) = self.first_fit_at(n.left, after, need) {
                return Some(g);
            }
            if n.end - n.start >= need {
                return Some((n.start, n.end));
            }
        }
        self.first_fit_at(n.right, after, need)
    }

    /// The lowest gap of at least `need` bytes starting above `after`.
    pub fn first_fit(&self, after: Option<u64>, need: u64) -> Option<(u64, u64)> {
        if after.is_some() {
            return self.first_fit_at(self.root, after, need);
        }
        // Without a lower bound the walk never backtracks: a subtree whose
        // longest gap is long enough holds the answer.
        let mut t = self.root;
        if self.max_len(t) < need {
            return None;
        }
        loop {
            let n = self.node(t);
            if self.max_len(n.left) >= need {
                t = n.left;
            } else if n.end - n.start >= need {
                return Some((n.start, n.end));
            } else {
                t = n.right;
            }
        }
    }

    fn collect(&self, t: u32, out: &mut Vec<(u64, u64)>) {
        if t != NIL {
            self.collect(self.node(t).left, out);
            out.push((self.node(t).start, self.node(t).end));
            self.collect(self.node(t).right, out);
        }
    }

    /// Every gap in address order.
    pub fn to_vec(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        self.collect(self.root, &mut out);
        out
    }

    fn check_at(&self, t: u32, lo: u64, hi: u64) -> Result<u64, String> {
        if t == NIL {
            return Ok(0);
        }
        let n = self.node(t);
        if n.start < lo || n.start >= hi || n.start >= n.end {
            return Err(format!(
                "gap index: node [{:#x}, {:#x}) out of order",
                n.start, n.end
            ));
        }
        for c in [n.left, n.right] {
            if c != NIL && self.node(c).prio > n.prio {
                return Err("gap index: heap order broken".into());
            }
        }
        let l = self.check_at(n.left, lo, n.start)?;
        let r = self.check_at(n.right, n.start + 1, hi)?;
        let m = l.max(r).max(n.end - n.start);
        if m != n.max_len {
            return Err(format!(
                "gap index: node {:#x} has max {:#x}, recount {m:#x}",
                n.start, n.max_len
            ));
        }
        Ok(m)
    }

    /// Checks the tree's order, heap and longest-gap fields.
    pub fn check(&self) -> Result<(), String> {
        self.check_at(self.root, 0, u64::MAX).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reference: the gaps as a sorted list.
    fn first_fit_ref(v: &[(u64, u64)], after: Option<u64>, need: u64) -> Option<(u64, u64)> {
        v.iter()
            .copied()
            .find(|&(s, e)| after.is_none_or(|a| s > a) && e - s >= need)
    }

    #[test]
    fn matches_a_sorted_list() {
        let mut g = Gaps::new(0, 1 << 40);
        let mut occupied: Vec<(u64, u64)> = Vec::new();
        let mut x: u64 = 7;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..3000 {
            let r = rnd();
            if occupied.is_empty() || r % 3 != 0 {
                let need = (r >> 8) % 64 + 1;
                let v = g.to_vec();
                let Some((s, e)) = first_fit_ref(&v, None, need) else {
                    continue;
                };
                assert_eq!(g.first_fit(None, need), Some((s, e)), "step {step}");
                let after = v.get((r as usize >> 3) % v.len()).map(|g| g.0);
                assert_eq!(g.first_fit(after, need), first_fit_ref(&v, after, need));
                // Carve at the gap's start, its end or inside it.
                let off = match r % 5 {
                    0 | 1 => 0,
                    2 => e - s - need,
                    _ => (r >> 20) % (e - s - need + 1),
                };
                assert!(g.carve(s + off, s + off + need));
                occupied.push((s + off, s + off + need));
                // An occupied range is held by no gap.
                let before = g.to_vec();
                assert!(!g.carve(s + off, s + off + 1));
                assert_eq!(g.to_vec(), before);
            } else {
                let (s, e) = occupied.swap_remove((r >> 5) as usize % occupied.len());
                g.release(s, e);
            }
            g.check().unwrap();
            // The gaps are exactly the complement of the occupied ranges.
            let mut occ = occupied.clone();
            occ.sort();
            let mut want = Vec::new();
            let mut cursor = 0;
            for &(s, e) in &occ {
                if s > cursor {
                    want.push((cursor, s));
                }
                cursor = e;
            }
            if cursor < 1 << 40 {
                want.push((cursor, 1 << 40));
            }
            assert_eq!(g.to_vec(), want, "step {step}");
        }
    }
}
