//! A walk over an Avro datum before `apache-avro` decodes it, refusing what the decoder
//! would otherwise trust: a length, `fixed` size or item count larger than the payload
//! (the decoder allocates what the prefix or schema claims before reading a byte of it)
//! and values nested
//! deeper than [`MAX_DEPTH`] (the decoder recurses once per level, so a recursive schema
//! and a short payload could overflow the stack). Anything else that is wrong with the
//! bytes is left to the decoder, which reports it as before.

use apache_avro::schema::{Name, Namespace, ResolvedSchema, Schema};

/// How deeply records, arrays, maps and unions may nest in one datum (a union's branch
/// and a record's field each count one level). The decoder's frames are large (tens of
/// KB each in a debug build): 32 levels fit a 2 MiB stack, a tokio worker's, with room
/// to spare; an ordinary schema nests far less.
pub const MAX_DEPTH: usize = 32;

/// Items of no width (nulls, empty records) an array may hold past the payload's length
/// in bytes.
pub const ZERO_WIDTH_ITEMS: usize = 65_536;

/// Why a datum is refused before decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// A string or bytes length, or a fixed-size value, is longer than what is left of
    /// the payload.
    Truncated,
    /// Values nest deeper than [`MAX_DEPTH`].
    TooDeep,
    /// Arrays and maps claim more items in all than the payload has bytes (plus
    /// [`ZERO_WIDTH_ITEMS`]).
    TooManyItems,
}

enum Stop {
    Refused(Refusal),
    /// Bytes the decoder refuses on its own (a bad varint, union index, short fixed
    /// read): the walk ends and the decoder reports it.
    Malformed,
}

impl From<Refusal> for Stop {
    fn from(r: Refusal) -> Self {
        Stop::Refused(r)
    }
}

/// Walks `datum` as written with `schema`.
pub(super) fn check(schema: &Schema, datum: &[u8]) -> Result<(), Refusal> {
    let mut walk = Walk {
        root: schema,
        names: None,
        rest: datum,
        items: datum.len().saturating_add(ZERO_WIDTH_ITEMS),
    };
    match walk.value(schema, &None, 0) {
        Ok(()) | Err(Stop::Malformed) => Ok(()),
        Err(Stop::Refused(r)) => Err(r),
    }
}

struct Walk<'s, 'b> {
    root: &'s Schema,
    /// The named types, resolved at the first reference to one.
    names: Option<ResolvedSchema<'s>>,
    rest: &'b [u8],
    /// Items arrays and maps may still claim: every item but a zero-width one (a null,
    /// an empty record) takes at least a byte, so a valid datum claims no more items
    /// than it has bytes (plus [`ZERO_WIDTH_ITEMS`] of no width).
    items: usize,
}

impl<'s> Walk<'s, '_> {
    /// A zig-zag varint, as the decoder reads it (at most 10 bytes).
    fn long(&mut self) -> Result<i64, Stop> {
        let mut n: u64 = 0;
        for i in 0..10 {
            let (&byte, rest) = self.rest.split_first().ok_or(Stop::Malformed)?;
            self.rest = rest;
            n |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok((n >> 1) as i64 ^ -((n & 1) as i64));
            }
        }
        Err(Stop::Malformed)
    }

    /// A value of a fixed size: the schema's own `fixed` size too, which the decoder
    /// allocates before reading.
    fn fixed(&mut self, len: usize) -> Result<(), Stop> {
        self.rest = self.rest.get(len..).ok_or(Refusal::Truncated)?;
        Ok(())
    }

    /// A length-prefixed string or bytes.
    fn bytes(&mut self) -> Result<(), Stop> {
        let len = usize::try_from(self.long()?).map_err(|_| Stop::Malformed)?;
        self.rest = self.rest.get(len..).ok_or(Refusal::Truncated)?;
        Ok(())
    }

    fn value(&mut self, schema: &'s Schema, ns: &Namespace, depth: usize) -> Result<(), Stop> {
        if depth > MAX_DEPTH {
            return Err(Refusal::TooDeep.into());
        }
        match schema {
            Schema::Null => Ok(()),
            Schema::Boolean => self.fixed(1),
            Schema::Float => self.fixed(4),
            Schema::Double => self.fixed(8),
            Schema::Duration => self.fixed(12),
            Schema::Fixed(fixed) => self.fixed(fixed.size),
            Schema::Bytes | Schema::String | Schema::BigDecimal | Schema::Uuid => self.bytes(),
            Schema::Decimal(decimal) => self.value(&decimal.inner, ns, depth),
            Schema::Array(array) => self.blocks(&array.items, false, ns, depth + 1),
            Schema::Map(map) => self.blocks(&map.types, true, ns, depth + 1),
            Schema::Union(union) => {
                let index = usize::try_from(self.long()?).map_err(|_| Stop::Malformed)?;
                let branch = union.variants().get(index).ok_or(Stop::Malformed)?;
                self.value(branch, ns, depth + 1)
            }
            Schema::Record(record) => {
                let inner = record.name.fully_qualified_name(ns).namespace;
                for field in &record.fields {
                    self.value(&field.schema, &inner, depth + 1)?;
                }
                Ok(())
            }
            Schema::Ref { name } => {
                let name = name.fully_qualified_name(ns);
                let named = self.named(&name)?;
                self.value(named, &name.namespace, depth)
            }
            // Int, Long, Enum and the date and time types: one varint.
            _ => self.long().map(drop),
        }
    }

    fn named(&mut self, name: &Name) -> Result<&'s Schema, Stop> {
        if self.names.is_none() {
            let root: &'s Schema = self.root;
            self.names = Some(ResolvedSchema::try_from(root).map_err(|_| Stop::Malformed)?);
        }
        let names = self.names.as_ref().ok_or(Stop::Malformed)?;
        names.get_names().get(name).copied().ok_or(Stop::Malformed)
    }

    /// An array's or map's blocks: a count (negative: followed by the block's size in
    /// bytes), the items, until a count of 0.
    fn blocks(
        &mut self,
        items: &'s Schema,
        keyed: bool,
        ns: &Namespace,
        depth: usize,
    ) -> Result<(), Stop> {
        loop {
            let count = self.long()?;
            if count == 0 {
                return Ok(());
            }
            if count < 0 {
                self.long()?;
            }
            let count = usize::try_from(count.unsigned_abs()).map_err(|_| Stop::Malformed)?;
            self.items = self.items.checked_sub(count).ok_or(Refusal::TooManyItems)?;
            for _ in 0..count {
                if keyed {
                    self.bytes()?;
                }
                self.value(items, ns, depth)?;
            }
        }
    }
}
