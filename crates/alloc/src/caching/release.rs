//! Giving memory back, events and garbage collection (`DeviceCachingAllocator`'s
//! `release_*`, `unmap_block`, `*_events`, `garbage_collect_cached_blocks`).

use super::block::{BlockId, SizeKey};
use super::engine::{AllocParams, State};
use super::sizes::PoolKind;
use crate::AllocResult;
use vmmalloc_device::{Device, Event, Stream};

impl State {
    /// `release_available_cached_blocks`: with `max_split_size` set, frees the
    /// smallest cached oversize block of the stream that covers the request, or
    /// else oversize blocks from the largest down until as many bytes are free.
    /// Blocks of expandable segments are skipped (PyTorch PR #134338).
    pub fn release_available_cached_blocks<D: Device>(
        &mut self,
        dev: &D,
        p: &AllocParams,
    ) -> AllocResult<bool> {
        if !self.config.has_split_limit() {
            return Ok(false);
        }
        let max_split = self.config.max_split_size;
        let key_size = p.size.max(max_split);
        let pool = self.pool(p.pool);
        let lower = pool.blocks.stream_from(p.stream, key_size, 0).next();
        match lower {
            Some(k) if k.0 == p.stream && self.slab.get(k.3).segment.is_none() => {
                self.release_block(dev, k.3)?;
            }
            _ => {
                // No single block is large enough; free multiple oversize blocks,
                // starting with the largest (of this stream: the loop below
                // stops at another stream's block).
                let before: Vec<SizeKey> = pool
                    .blocks
                    .stream_below_rev(p.stream, lower.map(|k| (k.1, k.2)))
                    .collect();
                if before.is_empty() {
                    return Ok(false);
                }
                let mut total_released = 0;
                for k in before {
                    if !(total_released < key_size && k.1 >= max_split && k.0 == p.stream) {
                        break;
                    }
                    let b = self.slab.get(k.3);
                    if b.segment.is_none() && !b.is_split() {
                        self.release_block(dev, k.3)?;
                        total_released += k.1;
                    }
                }
                if total_released < key_size {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// `release_cached_blocks` (also `emptyCache`): waits for every outstanding
    /// event (`synchronize_and_free_events`), then frees every unsplit cached
    /// segment and unmaps every free page of the expandable segments.
    pub fn release_cached_blocks<D: Device>(&mut self, dev: &D) -> AllocResult<bool> {
        self.synchronize_and_free_events(dev)?;
        self.release_blocks(dev, PoolKind::Large)?;
        self.release_blocks(dev, PoolKind::Small)?;
        Ok(true)
    }

    /// `release_blocks`: `cudaFree`s the pool's unsplit free segments; unmaps the
    /// whole pages of its free expandable blocks and frees a segment left with
    /// nothing mapped.
    pub fn release_blocks<D: Device>(&mut self, dev: &D, kind: PoolKind) -> AllocResult<()> {
        let keys: Vec<SizeKey> = self.pool(kind).blocks.iter().collect();
        let mut to_unmap = Vec::new();
        for k in keys {
            let b = self.slab.get(k.3);
            if b.segment.is_some() {
                to_unmap.push(k.3);
            } else if !b.is_split() {
                self.release_block(dev, k.3)?;
            }
        }
        for id in to_unmap {
            self.unmap_block(dev, id)?;
            let b = self.slab.get(id);
            if !b.is_split() && !b.mapped {
                self.release_expandable_segment(dev, id)?;
            }
        }
        Ok(())
    }

    /// `release_block`: `cudaFree`s a cached unsplit segment. On a driver error
    /// nothing changes.
    pub fn release_block<D: Device>(&mut self, dev: &D, id: BlockId) -> AllocResult<()> {
        let (ptr, size, pool) = {
            let b = self.slab.get(id);
            debug_assert!(b.segment.is_none() && !b.is_split() && b.is_allocatable());
            (b.ptr, b.size, b.pool)
        };
        self.calls.free(dev, ptr, size)?;
        self.stats.num_device_free += 1;
        self.total_allocated_memory -= size;
        let st = pool.stat_type();
        self.stats.segment.update(st, -1);
        self.stats.reserved_bytes.update(st, -(size as i64));
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.update(-1);
        }
        self.erase_from_blocks(id);
        self.slab.remove(id);
        self.segments.remove(&ptr);
        Ok(())
    }

    /// `unmap_block`: unmaps the whole pages inside a free expandable block
    /// (after a stream synchronize), leaving the partial pages at either end as
    /// free mapped blocks. If the driver fails midway, the pages already unmapped
    /// are accounted for and the error returned.
    pub fn unmap_block<D: Device>(&mut self, dev: &D, id: BlockId) -> AllocResult<()> {
        let (es_id, ptr, size, pool, stream, prev, next) = {
            let b = self.slab.get(id);
            (
                b.segment.expect("expandable block"),
                b.ptr,
                b.size,
                b.pool,
                b.stream,
                b.prev,
                b.next,
            )
        };
        let es = self
            .expandable_segments
            .get_mut(&es_id)
            .expect("live segment");
        let (uptr, usize, error) = match es.unmap(dev, &mut self.calls, ptr, size) {
            Ok((p, s)) => (p, s, None),
            Err(pu) => (pu.ptr, pu.size, Some(pu.error)),
        };
        if usize > 0 {
            self.erase_from_blocks(id);
            let before = uptr - ptr;
            if before > 0 {
                // prev? -> before_free -> block
                let mut bf = super::block::Block::new(stream, before, pool, ptr, Some(es_id));
                bf.prev = prev;
                bf.next = Some(id);
                let bfid = self.slab.insert(bf);
                if let Some(pp) = prev {
                    self.slab.get_mut(pp).next = Some(bfid);
                }
                self.slab.get_mut(id).prev = Some(bfid);
                self.insert_into_blocks(bfid);
            }
            let after = size - (before + usize);
            if after > 0 {
                // block -> after_free -> next?
                let mut af =
                    super::block::Block::new(stream, after, pool, uptr + usize, Some(es_id));
                af.prev = Some(id);
                af.next = next;
                let afid = self.slab.insert(af);
                if let Some(nn) = next {
                    self.slab.get_mut(nn).prev = Some(afid);
                }
                self.slab.get_mut(id).next = Some(afid);
                self.insert_into_blocks(afid);
            }
            self.slab.set_ptr(id, uptr);
            {
                let b = self.slab.get_mut(id);
                b.size = usize;
                b.mapped = false;
            }
            let prev = self.slab.get(id).prev;
            self.try_merge_blocks(id, prev);
            let next = self.slab.get(id).next;
            self.try_merge_blocks(id, next);
            let key = self.slab.get(id).addr_key(id);
            self.pool_mut(pool).unmapped.insert(key);
            self.total_allocated_memory -= usize;
            self.stats
                .reserved_bytes
                .update(pool.stat_type(), -(usize as i64));
            self.stats.num_device_free += 1;
        }
        match error {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// `release_expandable_segment`: frees the reservation of a segment with
    /// nothing mapped (`~ExpandableSegment`: `cuMemAddressFree`).
    pub fn release_expandable_segment<D: Device>(
        &mut self,
        dev: &D,
        id: BlockId,
    ) -> AllocResult<()> {
        let (es_id, pool) = {
            let b = self.slab.get(id);
            (b.segment.expect("expandable block"), b.pool)
        };
        let es = &self.expandable_segments[&es_id];
        debug_assert_eq!(
            self.slab.get(id).size,
            es.size(),
            "block disagrees with segment"
        );
        let (ptr, size) = (es.ptr, es.size());
        self.calls.free_reservation(dev, es.id, ptr, size)?;
        self.expandable_segments.remove(&es_id);
        let key = self.slab.get(id).addr_key(id);
        self.pool_mut(pool).unmapped.remove(&key);
        self.slab.remove(id);
        Ok(())
    }

    /// The first half of `insert_events`: takes an event from the pool (or
    /// creates one) and records it on every stream that used the block. On a
    /// driver error the events go back to the pool and nothing else changes.
    pub fn record_events<D: Device>(
        &mut self,
        dev: &D,
        id: BlockId,
    ) -> AllocResult<Vec<(Stream, Event)>> {
        let streams: Vec<Stream> = self.slab.get(id).stream_uses.iter().copied().collect();
        let mut out: Vec<(Stream, Event)> = Vec::with_capacity(streams.len());
        for s in streams {
            let ev = match self.event_pool.pop() {
                Some(ev) => ev,
                None => match self.calls.observers.create_event(dev) {
                    Ok(ev) => ev,
                    Err(e) => {
                        self.event_pool.extend(out.into_iter().map(|(_, ev)| ev));
                        return Err(e.into());
                    }
                },
            };
            if let Err(e) = self.calls.observers.record_event(dev, ev, s) {
                self.event_pool.push(ev);
                self.event_pool.extend(out.into_iter().map(|(_, ev)| ev));
                return Err(e.into());
            }
            out.push((s, ev));
        }
        Ok(out)
    }

    /// The second half of `insert_events`: the block waits for the events.
    pub fn insert_events(&mut self, id: BlockId, events: Vec<(Stream, Event)>) {
        let b = self.slab.get_mut(id);
        b.stream_uses.clear();
        b.event_count += events.len() as u32;
        for (s, ev) in events {
            self.cuda_events.entry(s).or_default().push_back((ev, id));
        }
    }

    /// Marks one event of a block done; frees the block after its last one.
    fn event_done(&mut self, ev: Event, id: BlockId) {
        self.event_pool.push(ev);
        let b = self.slab.get_mut(id);
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(id);
        }
    }

    /// `process_events`: per stream, in order, frees the blocks whose events
    /// have completed (`cudaEventQuery`), stopping at the first pending one.
    pub fn process_events<D: Device>(&mut self, dev: &D) -> AllocResult<()> {
        if self.cuda_events.is_empty() {
            return Ok(());
        }
        let streams: Vec<Stream> = self.cuda_events.keys().copied().collect();
        for s in streams {
            while let Some(&(ev, id)) = self.cuda_events.get(&s).and_then(|q| q.front()) {
                if !self.calls.observers.query_event(dev, ev)? {
                    break;
                }
                if let Some(q) = self.cuda_events.get_mut(&s) {
                    q.pop_front();
                }
                self.event_done(ev, id);
            }
            if self.cuda_events.get(&s).is_some_and(|q| q.is_empty()) {
                self.cuda_events.remove(&s);
            }
        }
        Ok(())
    }

    /// `synchronize_and_free_events`: waits for every outstanding event
    /// (`cudaEventSynchronize`) and frees its block; counts `num_sync_all_streams`.
    pub fn synchronize_and_free_events<D: Device>(&mut self, dev: &D) -> AllocResult<()> {
        self.stats.num_sync_all_streams += 1;
        while let Some((&s, q)) = self.cuda_events.iter().next() {
            let Some(&(ev, id)) = q.front() else {
                self.cuda_events.remove(&s);
                continue;
            };
            self.calls.observers.sync_event(dev, ev)?;
            if let Some(q) = self.cuda_events.get_mut(&s) {
                q.pop_front();
            }
            self.event_done(ev, id);
        }
        Ok(())
    }

    /// `garbage_collect_cached_blocks`: when the memory held exceeds
    /// `garbage_collection_threshold × allowed_memory_maximum`, frees unsplit
    /// cached large-pool segments not reused for at least the average age
    /// (ages count `get_free_block` calls), repeating until the excess is freed.
    /// No synchronization. Blocks of expandable segments are skipped.
    pub fn garbage_collect_cached_blocks<D: Device>(&mut self, dev: &D) -> AllocResult<()> {
        let gc_threshold =
            (self.config.garbage_collection_threshold * self.allowed_memory_maximum as f64) as u64;
        if self.total_allocated_memory <= gc_threshold {
            return Ok(());
        }
        let target_size = self.total_allocated_memory - gc_threshold;
        let mut gc_reclaimed = 0;
        let clock = self.large_blocks.get_free_blocks_call_count;
        let age = |base: i64| (clock - base).max(0) as u64;
        let freeable = |s: &State, k: &SizeKey| {
            let b = s.slab.get(k.3);
            !b.is_split() && b.segment.is_none()
        };
        let mut total_age: u64 = 0;
        let mut freeable_block_count: u64 = 0;
        for k in self.large_blocks.blocks.iter() {
            if freeable(self, &k) {
                total_age += age(self.slab.get(k.3).gc_count_base);
                freeable_block_count += 1;
            }
        }
        if freeable_block_count == 0 {
            return Ok(());
        }
        let mut block_freed = true;
        while gc_reclaimed < target_size && block_freed && freeable_block_count > 0 {
            let age_threshold = total_age as f64 / freeable_block_count as f64;
            block_freed = false;
            let keys: Vec<SizeKey> = self.large_blocks.blocks.iter().collect();
            for k in keys {
                if !freeable(self, &k) {
                    continue;
                }
                let a = age(self.slab.get(k.3).gc_count_base);
                if a as f64 >= age_threshold {
                    block_freed = true;
                    gc_reclaimed += k.1;
                    total_age -= a;
                    freeable_block_count -= 1;
                    self.release_block(dev, k.3)?;
                }
            }
        }
        Ok(())
    }
}
