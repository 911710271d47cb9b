//! Canonical JSON for fingerprints: object members sorted by name, insignificant whitespace
//! dropped, strings re-encoded from their decoded text, numbers kept exactly as written.

/// Deeper nesting than this is not canonicalised (the body is then hashed as sent), so that a
/// hostile body cannot exhaust the stack.
const MAX_DEPTH: usize = 128;

/// The canonical form of `input`, or `None` if it is not one JSON value.
pub(crate) fn canonical(input: &[u8]) -> Option<Vec<u8>> {
    let mut parser = Parser { input, pos: 0 };
    let mut out = Vec::with_capacity(input.len());
    parser.value(&mut out, 0)?;
    parser.skip_ws();
    (parser.pos == input.len()).then_some(out)
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self
            .input
            .get(self.pos)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.input.get(self.pos).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'{' => self.object(out, depth),
            b'[' => self.array(out, depth),
            b'"' => {
                let text = self.string()?;
                out.extend_from_slice(serde_json::to_string(&text).ok()?.as_bytes());
                Some(())
            }
            b't' => self.literal(out, b"true"),
            b'f' => self.literal(out, b"false"),
            b'n' => self.literal(out, b"null"),
            _ => self.number(out),
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.pos += 1;
        let mut members: Vec<(String, Vec<u8>)> = Vec::new();
        if !self.eat(b'}') {
            loop {
                if self.peek()? != b'"' {
                    return None;
                }
                let name = self.string()?;
                if !self.eat(b':') {
                    return None;
                }
                let mut value = Vec::new();
                self.value(&mut value, depth + 1)?;
                members.push((name, value));
                if self.eat(b'}') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
            }
        }
        // Stable: members with the same name keep their order.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        out.push(b'{');
        for (i, (name, value)) in members.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(serde_json::to_string(name).ok()?.as_bytes());
            out.push(b':');
            out.extend_from_slice(value);
        }
        out.push(b'}');
        Some(())
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Option<()> {
        self.pos += 1;
        out.push(b'[');
        if !self.eat(b']') {
            loop {
                self.value(out, depth + 1)?;
                if self.eat(b']') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
                out.push(b',');
            }
        }
        out.push(b']');
        Some(())
    }

    /// A string token, decoded by serde_json (escapes, surrogate pairs, control characters).
    fn string(&mut self) -> Option<String> {
        let start = self.pos;
        let mut i = start + 1;
        loop {
            match self.input.get(i)? {
                b'\\' => i += 2,
                b'"' => break,
                _ => i += 1,
            }
        }
        self.pos = i + 1;
        serde_json::from_slice(self.input.get(start..=i)?).ok()
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &[u8]) -> Option<()> {
        let end = self.pos + word.len();
        if self.input.get(self.pos..end)? != word {
            return None;
        }
        self.pos = end;
        out.extend_from_slice(word);
        Some(())
    }

    /// A number, kept as written once serde_json has checked its grammar.
    fn number(&mut self, out: &mut Vec<u8>) -> Option<()> {
        let start = self.pos;
        let len = self.input[start..]
            .iter()
            .take_while(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
            .count();
        let token = &self.input[start..start + len];
        if len == 0 || serde_json::from_slice::<serde_json::Number>(token).is_err() {
            return None;
        }
        self.pos += len;
        out.extend_from_slice(token);
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::canonical;

    fn canon(s: &str) -> Option<String> {
        canonical(s.as_bytes()).map(|b| String::from_utf8(b).expect("utf-8"))
    }

    #[test]
    fn members_are_sorted_and_whitespace_dropped() {
        let a = canon(r#"{"b": 1, "a": {"y": [1, 2], "x": null}}"#);
        let b = canon("{\n\t\"a\":{\"x\":null,\"y\":[1,2]},\"b\":1 }");
        assert_eq!(a.as_deref(), Some(r#"{"a":{"x":null,"y":[1,2]},"b":1}"#));
        assert_eq!(a, b);
    }

    #[test]
    fn numbers_keep_their_written_form_and_strings_their_text() {
        assert_eq!(canon("1.0"), Some("1.0".into()));
        assert_ne!(canon("1.0"), canon("1"));
        assert_eq!(
            canon("123456789012345678901234567890"),
            Some("123456789012345678901234567890".into())
        );
        assert_eq!(canon(r#""\u0041\/""#), canon(r#""A/""#));
        assert_eq!(
            canon(r#"[true,false,null,-1e5]"#),
            Some("[true,false,null,-1e5]".into())
        );
    }

    #[test]
    fn invalid_json_and_deep_nesting_give_none() {
        for bad in [
            "",
            "{",
            "{\"a\"}",
            "[1,]",
            "01",
            "1 2",
            "tru",
            "\"abc",
            "{\"a\":1,}",
            "--1",
        ] {
            assert_eq!(canon(bad), None, "{bad}");
        }
        let deep = "[".repeat(10_000) + &"]".repeat(10_000);
        assert_eq!(canon(&deep), None);
    }
}
