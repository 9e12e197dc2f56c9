//! Collections that never hold more than the bound their type states.
//!
//! The engine remembers windows, repeats, drills and histories between inputs, and every one
//! of those memories must stay bounded whatever a storm or a hand-edited `state.json` brings.
//! Instead of a check at each insert, another at each load and a third in the tests, the
//! bound is part of the type: every insert says what makes room when the collection is full
//! (the stalest entry goes, or the insert is refused), reading goes through `Deref` to the
//! plain collection, and a file that holds more than the bound is refused as it is read,
//! before the extra entries are kept. The JSON is the plain map's or list's, so a state
//! written before these types reads the same.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

fn too_many<E: de::Error>(bound: usize) -> E {
    E::custom(format!(
        "a collection holds more than {bound} entries, the most the engine keeps"
    ))
}

/// A map of at most `N` entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedMap<K, V, const N: usize>(BTreeMap<K, V>);

impl<K, V, const N: usize> Default for BoundedMap<K, V, N> {
    fn default() -> Self {
        BoundedMap(BTreeMap::new())
    }
}

impl<K, V, const N: usize> Deref for BoundedMap<K, V, N> {
    type Target = BTreeMap<K, V>;
    fn deref(&self) -> &BTreeMap<K, V> {
        &self.0
    }
}

impl<K: Ord + Clone, V, const N: usize> BoundedMap<K, V, N> {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether a new key would first have to make room.
    pub fn is_full(&self) -> bool {
        self.0.len() >= N
    }

    /// Inserts `value` at `key`. A new key in a full map first removes the entry whose
    /// `stalest` is smallest (the first such in key order). Returns the value `key` had.
    pub fn insert_evicting<T: Ord>(
        &mut self,
        key: K,
        value: V,
        stalest: impl Fn(&V) -> T,
    ) -> Option<V> {
        self.make_room_for(&key, stalest);
        self.0.insert(key, value)
    }

    /// The value at `key`, made by `make` when absent (room made as [`Self::insert_evicting`]
    /// does).
    pub fn get_or_insert_evicting<T: Ord>(
        &mut self,
        key: K,
        make: impl FnOnce() -> V,
        stalest: impl Fn(&V) -> T,
    ) -> &mut V {
        self.make_room_for(&key, stalest);
        self.0.entry(key).or_insert_with(make)
    }

    /// Inserts when `key` is present or there is room; a new key in a full map is refused
    /// and handed back.
    pub fn try_insert(&mut self, key: K, value: V) -> Result<Option<V>, (K, V)> {
        if self.is_full() && !self.0.contains_key(&key) {
            return Err((key, value));
        }
        Ok(self.0.insert(key, value))
    }

    fn make_room_for<T: Ord>(&mut self, key: &K, stalest: impl Fn(&V) -> T) {
        if N == 0 || !self.is_full() || self.0.contains_key(key) {
            return;
        }
        let victim = self
            .0
            .iter()
            .min_by_key(|(_, v)| stalest(v))
            .map(|(k, _)| k.clone());
        if let Some(k) = victim {
            self.0.remove(&k);
        }
    }

    pub fn get_mut<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
    {
        self.0.get_mut(key)
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        self.0.remove(key)
    }

    pub fn retain(&mut self, keep: impl FnMut(&K, &mut V) -> bool) {
        self.0.retain(keep)
    }
}

impl<K: Serialize, V: Serialize, const N: usize> Serialize for BoundedMap<K, V, N> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, K, V, const N: usize> Deserialize<'de> for BoundedMap<K, V, N>
where
    K: Deserialize<'de> + Ord,
    V: Deserialize<'de>,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Read<K, V, const N: usize>(PhantomData<(K, V)>);
        impl<'de, K, V, const N: usize> Visitor<'de> for Read<K, V, N>
        where
            K: Deserialize<'de> + Ord,
            V: Deserialize<'de>,
        {
            type Value = BoundedMap<K, V, N>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a map of at most {N} entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((k, v)) = m.next_entry()? {
                    out.insert(k, v);
                    if out.len() > N {
                        return Err(too_many(N));
                    }
                }
                Ok(BoundedMap(out))
            }
        }
        d.deserialize_map(Read::<K, V, N>(PhantomData))
    }
}

/// A list of at most `N` items, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundedVec<T, const N: usize>(Vec<T>);

impl<T, const N: usize> Default for BoundedVec<T, N> {
    fn default() -> Self {
        BoundedVec(Vec::new())
    }
}

impl<T, const N: usize> Deref for BoundedVec<T, N> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T, const N: usize> BoundedVec<T, N> {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Appends `item`; a full list first drops its oldest (first) item.
    pub fn push_evicting(&mut self, item: T) {
        if N == 0 {
            return;
        }
        if self.0.len() >= N {
            self.0.remove(0);
        }
        self.0.push(item);
    }

    /// Appends `item`; a full list first drops the item whose `stalest` is smallest (the
    /// first such).
    pub fn push_evicting_by<K: Ord>(&mut self, item: T, stalest: impl Fn(&T) -> K) {
        if N == 0 {
            return;
        }
        if self.0.len() >= N
            && let Some(i) = self
                .0
                .iter()
                .enumerate()
                .min_by_key(|(_, t)| stalest(t))
                .map(|(i, _)| i)
        {
            self.0.remove(i);
        }
        self.0.push(item);
    }

    pub fn get_mut(&mut self, at: usize) -> Option<&mut T> {
        self.0.get_mut(at)
    }

    pub fn remove(&mut self, at: usize) -> T {
        self.0.remove(at)
    }

    pub fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        self.0.retain(keep)
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.0.iter_mut()
    }
}

impl<T: Clone, const N: usize> BoundedVec<T, N> {
    /// The newest `N` of `items`.
    pub fn newest(items: &[T]) -> Self {
        BoundedVec(items[items.len().saturating_sub(N)..].to_vec())
    }
}

impl<T: Serialize, const N: usize> Serialize for BoundedVec<T, N> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>, const N: usize> Deserialize<'de> for BoundedVec<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Read<T, const N: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for Read<T, N> {
            type Value = BoundedVec<T, N>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a list of at most {N} items")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(item) = s.next_element()? {
                    if out.len() >= N {
                        return Err(too_many(N));
                    }
                    out.push(item);
                }
                Ok(BoundedVec(out))
            }
        }
        d.deserialize_seq(Read::<T, N>(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_map_makes_room_by_its_stalest_entry_or_refuses() {
        let mut m: BoundedMap<&str, u32, 2> = BoundedMap::default();
        m.insert_evicting("a", 5, |v| *v);
        m.insert_evicting("b", 3, |v| *v);
        assert_eq!(
            m.insert_evicting("a", 9, |v| *v),
            Some(5),
            "present: no room made"
        );
        m.insert_evicting("c", 7, |v| *v);
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(m.try_insert("d", 1), Err(("d", 1)));
        assert_eq!(m.try_insert("c", 1), Ok(Some(7)));
        *m.get_or_insert_evicting("e", || 0, |v| *v) += 4;
        assert_eq!(
            m.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [("a", 9), ("e", 4)]
        );
    }

    #[test]
    fn a_full_list_drops_its_oldest() {
        let mut v: BoundedVec<u32, 3> = BoundedVec::default();
        for i in 0..5 {
            v.push_evicting(i);
        }
        assert_eq!(*v, vec![2, 3, 4]);
        assert_eq!(*BoundedVec::<u32, 2>::newest(&[1, 2, 3]), vec![2, 3]);
        let mut v: BoundedVec<u32, 3> = BoundedVec::default();
        for i in [5, 1, 7, 1, 9] {
            v.push_evicting_by(i, |t| *t);
        }
        assert_eq!(*v, vec![5, 7, 9], "the first smallest goes first");
    }

    #[test]
    fn a_file_holding_more_than_the_bound_is_refused_as_it_is_read() {
        let m: BoundedMap<String, u32, 2> = serde_json::from_str(r#"{"a":1,"b":2}"#).unwrap();
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"a":1,"b":2}"#);
        let e = serde_json::from_str::<BoundedMap<String, u32, 2>>(r#"{"a":1,"b":2,"c":3}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 2 entries"), "{e}");
        let v: BoundedVec<u32, 2> = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), "[1,2]");
        assert!(serde_json::from_str::<BoundedVec<u32, 2>>("[1,2,3]").is_err());
        assert!(serde_json::from_str::<BoundedVec<u32, 2>>("{}").is_err());
    }
}
